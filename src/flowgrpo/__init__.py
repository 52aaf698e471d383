"""FlowGRPO: online RL fine-tuning of image generators as gRPC services over a ZeroMQ data bus.

This package is the library the services share. It imports without torch: torch is loaded
only where tensors are made (``flowgrpo.bus.torch_tensors``) and by the model code.
"""

__version__ = "0.1.0"
PROTOCOL_VERSION = "flowgrpo.v1"
