// The UCX transport (comm.transport "ucx"): frames over UCP streams, for RDMA NICs
// (InfiniBand, RoCE), shared memory between processes of one host, and TCP, whichever
// UCX picks or UCX_TLS allows. Endpoints are "host:port", like TCP's: a listener is a
// UCP sockaddr listener, and UCX's connection manager sets up the fastest lanes to it.
//
// Names: "ucx" (UCX's own choice, with UCX_* variables honoured) or "ucx:<tls>", which
// sets UCX_TLS for that transport only ("ucx:tcp", "ucx:sm", "ucx:rc,sm"): one UCP
// context, worker and progress thread per name and process.
//
// UCX is optional: the build compiles this with UCX's headers when it finds them
// (BPS_HAVE_UCX) and loads libucp at run time, so a build or a machine without UCX runs
// every other transport and `ucx` fails at init with the reason.
#pragma once

#include <memory>
#include <string>

#include "transport.h"

namespace bps {

// The UCX transport called `name` ("ucx" or "ucx:<tls>"); one shared instance per name.
// Throws Error(kConfig) saying why UCX cannot be used (not in this build, libucp not
// found, UCX failed to start).
std::shared_ptr<Transport> GetUcxTransport(const std::string& name);

}  // namespace bps
