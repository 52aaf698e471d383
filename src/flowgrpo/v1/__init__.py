"""Generated protobuf and gRPC code of ``protos/flowgrpo/v1`` (``python -m flowgrpo.protogen``)."""
