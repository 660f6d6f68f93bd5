#!/usr/bin/env python3
"""A do-nothing OTLP/gRPC trace receiver for benchmarks: accepts every Export call and
answers success (an empty ExportTraceServiceResponse is zero bytes), so a process under
test pays the whole cost of exporting its spans. Prints its address, then serves until
killed.

    otlp_sink.py [port]     (grpcio; `make prerequisites` puts it in target/pyenv)
"""
import sys
from concurrent import futures

import grpc

EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


class Sink(grpc.GenericRpcHandler):
    def __init__(self):
        self.spans_bytes = 0

    def service(self, details):
        if details.method != EXPORT:
            return None

        def export(request, context):
            self.spans_bytes += len(request)
            return b""

        return grpc.unary_unary_rpc_method_handler(export)


def main():
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((Sink(),))
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    print(f"127.0.0.1:{bound}", flush=True)
    server.wait_for_termination()


if __name__ == "__main__":
    main()
