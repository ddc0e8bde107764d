// The transports by name: the one place that knows every implementation (ps-lite's
// Van::Create). A new transport adds its include and one line here.
#include "inproc_transport.h"
#include "tcp_transport.h"
#include "transport.h"
#include "ucx_transport.h"

namespace bps {

std::shared_ptr<Transport> Transport::Get(const std::string& name) {
  static const std::shared_ptr<Transport> tcp = std::make_shared<TcpTransport>();
  static const std::shared_ptr<Transport> inproc = std::make_shared<InprocTransport>();
  if (name == "tcp" || name.empty()) return tcp;
  if (name == "inproc") return inproc;
  if (name == "ucx" || name.rfind("ucx:", 0) == 0) return GetUcxTransport(name);
  throw Error(Error::kConfig,
              "unknown transport; expected one of tcp, inproc, ucx, ucx:<UCX_TLS>. Received: transport=" + name);
}

}  // namespace bps
