"""Weight transfer by reshard plans: learner layout -> inference layout, in-process
(LocalTransfer) and across processes (PlanSender / PlanReceiver, steered by the `hcjax.Weights`
gRPC service in hcjax.transfer.weights_service); the package sees pytrees of arrays and
shardings, never a model."""

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
