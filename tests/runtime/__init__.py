"""Tests of the gRPC runtime, structured logs and tracing."""
