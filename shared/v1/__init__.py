"""Generated protobuf and gRPC modules (scripts/gen_proto.py). Do not edit."""
