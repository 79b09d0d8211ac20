"""Reference inference engine (in progress): sequence, block_manager, scheduler."""
from tpweave.engine.block_manager import BlockManager
from tpweave.engine.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from tpweave.engine.sequence import SamplingParams, Sequence, SequenceStatus

__all__ = ["BlockManager", "SamplingParams", "ScheduledChunk", "Scheduler", "SchedulerOutput", "Sequence", "SequenceStatus"]
