// UCX underneath the ucx transport: libucp's entry points, resolved at run time (the
// extension links no UCX library, so it loads on machines without one), and the one UCP
// context, worker and progress thread per UCX_TLS list that every link of the process
// shares. ucx_transport.cc builds links, listeners and the transport on top.
#pragma once

#include <string>

namespace bps {
namespace ucx {

// What the transport asks of a UCP context for UCX_TLS=tls, decided from UCX's version
// and the user's UCX_PROTO_ENABLE / UCX_RNDV_THRESH (null where unset). Pure, and built
// with or without UCX, so tests pin both sides of the version rule with one library.
struct ContextRules {
  bool protocols_v2;  // UCX's protocols v2 run (the default from 1.16; UCX_PROTO_ENABLE decides where set)
  bool eager_bodies;  // RNDV_THRESH=inf: every frame body goes eagerly (v1 over TCP alone)
};
ContextRules RulesFor(unsigned major, unsigned minor, const char* proto_enable, const char* rndv_thresh,
                      const std::string& tls);

}  // namespace ucx
}  // namespace bps

#ifdef BPS_HAVE_UCX

#include <ucp/api/ucp.h>

#include <atomic>
#include <string>
#include <thread>

namespace bps {
namespace ucx {

// The UCP functions this transport calls, resolved from libucp when it is first used:
// the extension links no UCX library, so it loads on machines without one.
struct UcpApi {
  decltype(&ucp_config_read) config_read;
  decltype(&ucp_config_modify) config_modify;
  decltype(&ucp_config_release) config_release;
  decltype(&ucp_init_version) init_version;
  decltype(&ucp_worker_create) worker_create;
  decltype(&ucp_worker_query) worker_query;
  decltype(&ucp_worker_get_efd) worker_get_efd;
  decltype(&ucp_worker_arm) worker_arm;
  decltype(&ucp_worker_progress) worker_progress;
  decltype(&ucp_worker_signal) worker_signal;
  decltype(&ucp_listener_create) listener_create;
  decltype(&ucp_listener_destroy) listener_destroy;
  decltype(&ucp_listener_query) listener_query;
  decltype(&ucp_listener_reject) listener_reject;
  decltype(&ucp_conn_request_query) conn_request_query;
  decltype(&ucp_ep_create) ep_create;
  decltype(&ucp_ep_close_nbx) ep_close_nbx;
  decltype(&ucp_ep_flush_nbx) ep_flush_nbx;
  decltype(&ucp_stream_send_nbx) stream_send_nbx;
  decltype(&ucp_stream_recv_nbx) stream_recv_nbx;
  decltype(&ucp_tag_send_nbx) tag_send_nbx;
  decltype(&ucp_tag_recv_nbx) tag_recv_nbx;
  decltype(&ucp_request_check_status) request_check_status;
  decltype(&ucp_request_free) request_free;
  decltype(&ucp_request_cancel) request_cancel;
  decltype(&ucs_status_string) status_string;
  decltype(&ucp_get_version) get_version;

  // The functions of libucp.so.0 (or BPSTRAIN_UCX_LIB); throws Error(kConfig) saying
  // what is missing. Loaded once per process.
  static const UcpApi& Get();
};

std::string Why(const UcpApi& api, ucs_status_t st);

// One UCP context and worker per transport name, and the thread that progresses it: every
// completion and callback of this process's UCX links runs there. Other threads post
// sends and receives (the worker is thread-safe, UCS_THREAD_MODE_MULTI) and wait on
// their own condition variables. Never destroyed: links may outlive any owner we could
// name, so the process's exit only stops the thread (ExitHook).
class UcxContext {
 public:
  explicit UcxContext(const std::string& tls);
  const UcpApi& api;
  ucp_worker_h worker() const { return worker_; }
  // Wakes the progress thread for an operation just posted.
  void Wake() { api.worker_signal(worker_); }
  void Stop() {
    if (stop_.exchange(true)) return;
    Wake();
    if (thread_.joinable()) thread_.join();
  }

 private:
  void ProgressLoop(int efd);
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// The context of UCX_TLS list `tls` ("" = UCX's choice), made on first use; the
// process's exit stops every context's progress thread.
UcxContext* ContextFor(const std::string& tls);

}  // namespace ucx
}  // namespace bps

#endif  // BPS_HAVE_UCX
