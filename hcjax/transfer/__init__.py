"""Weight transfer by reshard plans: learner layout -> inference layout, in-process and across
processes; the package sees pytrees of arrays and shardings, never a model."""

from hcjax.transfer.local import ExecutionResult, LocalTransfer, TransferError
from hcjax.transfer.remote import (
    JaxTransferBackend,
    PlanReceiver,
    PlanSender,
    TransferBackend,
    UntrustedPeer,
)
from hcjax.transfer.reshard_plan import (
    PlanError,
    TransferEntry,
    TransferPlan,
    assign_processes,
    make_plan,
)
from hcjax.transfer.transforms import Cast
from hcjax.transfer.versioned import TransferFailed, VersionedWeights

__all__ = [
    "Cast",
    "ExecutionResult",
    "JaxTransferBackend",
    "LocalTransfer",
    "PlanError",
    "PlanReceiver",
    "PlanSender",
    "TransferBackend",
    "TransferEntry",
    "TransferError",
    "TransferFailed",
    "TransferPlan",
    "UntrustedPeer",
    "VersionedWeights",
    "assign_processes",
    "make_plan",
]
