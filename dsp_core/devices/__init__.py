"""One plan over several devices: topologies, the placement pass, execution with transfer analytics.

    import dsp_core as dsp
    from dsp_core.devices import stub_topology
    with stub_topology([{"memory": 2**30}, {"memory": 2**30, "peers": [0]}]):
        model = dsp.compile("model.onnx", placement="pipeline_parallel")
        model.run(feeds)
        model.dsp.placement          # slot index -> device index (a Placement)
        model.dsp.transfers()        # per-step copy records, each with a typed reason

See docs/devices.md.
"""

from dsp_core.devices.placement import Cut, Placement, PlacementError, Strategy, place
from dsp_core.devices.topology import (
    HOST,
    Device,
    Topology,
    cuda_topology,
    current_topology,
    host_topology,
    stub_topology,
    use_topology,
)
from dsp_core.devices.transfers import Copy, Reason, StepTransfers, Switch, TransferRecorder

__all__ = [
    "HOST",
    "Copy",
    "Cut",
    "Device",
    "Placement",
    "PlacementError",
    "Reason",
    "StepTransfers",
    "Strategy",
    "Switch",
    "Topology",
    "TransferRecorder",
    "cuda_topology",
    "current_topology",
    "host_topology",
    "place",
    "stub_topology",
    "use_topology",
]
