"""Reference inference engine: sequence, block_manager, scheduler, model_runner, llm_engine."""

from tpweave.engine.block_manager import BlockManager
from tpweave.engine.config import EngineConfig
from tpweave.engine.llm_engine import LLMEngine
from tpweave.engine.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from tpweave.engine.sequence import MAX_LOGPROBS, SamplingParams, Sequence, SequenceStatus, TokenLogprobs

__all__ = [
    "LLMEngine",
    "BlockManager",
    "EngineConfig",
    "SamplingParams",
    "ScheduledChunk",
    "Scheduler",
    "SchedulerOutput",
    "Sequence",
    "SequenceStatus",
    "TokenLogprobs",
    "MAX_LOGPROBS",
]
