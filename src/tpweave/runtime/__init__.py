from tpweave.runtime.agreement import check_ranks_agree
from tpweave.runtime.context import TPContext
from tpweave.runtime.groups import destroy_distributed, init_distributed
from tpweave.runtime.launch import WorkerError, launch

__all__ = ["TPContext", "check_ranks_agree", "destroy_distributed", "init_distributed", "launch", "WorkerError"]
