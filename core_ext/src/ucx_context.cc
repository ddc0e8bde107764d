#include "ucx_context.h"

#include <cctype>

namespace bps {
namespace ucx {

ContextRules RulesFor(unsigned major, unsigned minor, const char* proto_enable, const char* rndv_thresh,
                      const std::string& tls) {
  ContextRules rules{};
  if (proto_enable && *proto_enable) {
    std::string v(proto_enable);
    for (char& c : v) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    rules.protocols_v2 = !(v == "n" || v == "no" || v == "0" || v == "off");
  } else {
    rules.protocols_v2 = major > 1 || (major == 1 && minor >= 16);  // UCX 1.16 made them the default
  }
  // Over TCP alone, UCX's first protocols (v1: before 1.16, or UCX_PROTO_ENABLE=n) do a
  // rendezvous as fragments copied in and out, a round trip per frame body (RTS, then the
  // data) that waits behind the link's queue: with UCX 1.13 on the emulated 4x4 hosts at
  // 800 Mbit/s, 64 MB push_pulls took 7.85 s with it and 1.54 s sent eagerly. Protocols
  // v2 (UCX 1.22 measured) write a rendezvous body zero-copy, and there it is the better
  // choice: one host, flat 64 MB over ucx:tcp 120-134 ms against 222 ms eager; VGG-16 with
  // CUDA tensors, four workers on one GPU host, 0.82-0.91x TCP against 0.46-0.54x eager;
  // the emulated hosts 0.91-0.97x either way. So the threshold goes to infinity for v1 only. RDMA transports
  // keep UCX's threshold (their rendezvous is the zero-copy path), and so does a user who
  // sets UCX_RNDV_THRESH.
  rules.eager_bodies = tls == "tcp" && rndv_thresh == nullptr && !rules.protocols_v2;
  return rules;
}

}  // namespace ucx
}  // namespace bps

#ifdef BPS_HAVE_UCX

#include <dlfcn.h>
#include <poll.h>

#include <cstdlib>
#include <map>
#include <mutex>
#include <vector>

#include "common.h"
#include "tuning.h"

namespace bps {
namespace ucx {

const UcpApi& UcpApi::Get() {
  static std::once_flag once;
  static UcpApi api;
  static std::string failure;
  std::call_once(once, [] {
    const char* env = std::getenv("BPSTRAIN_UCX_LIB");
    const std::string path = env && *env ? env : "libucp.so.0";
    // RTLD_GLOBAL: UCX loads its transports (libuct_*.so) as modules that expect it.
    void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL);
    if (!lib) {
      const char* why = dlerror();
      failure = "transport ucx: cannot load " + path + " (" + (why ? why : "not found") +
                "); install UCX (Debian/Ubuntu: apt install libucx0; for InfiniBand/RoCE NICs a UCX built "
                "with verbs, e.g. the distribution's or MLNX_OFED's) or set BPSTRAIN_UCX_LIB to libucp's path";
      return;
    }
    auto sym = [&](const char* name) {
      void* p = dlsym(lib, name);
      if (!p && failure.empty()) failure = "transport ucx: " + path + " has no " + name + " (UCX >= 1.12 is needed)";
      return p;
    };
#define BPS_UCP(field, name) api.field = reinterpret_cast<decltype(api.field)>(sym(#name))
    BPS_UCP(config_read, ucp_config_read);
    BPS_UCP(config_modify, ucp_config_modify);
    BPS_UCP(config_release, ucp_config_release);
    BPS_UCP(init_version, ucp_init_version);
    BPS_UCP(worker_create, ucp_worker_create);
    BPS_UCP(worker_query, ucp_worker_query);
    BPS_UCP(worker_get_efd, ucp_worker_get_efd);
    BPS_UCP(worker_arm, ucp_worker_arm);
    BPS_UCP(worker_progress, ucp_worker_progress);
    BPS_UCP(worker_signal, ucp_worker_signal);
    BPS_UCP(listener_create, ucp_listener_create);
    BPS_UCP(listener_destroy, ucp_listener_destroy);
    BPS_UCP(listener_query, ucp_listener_query);
    BPS_UCP(listener_reject, ucp_listener_reject);
    BPS_UCP(conn_request_query, ucp_conn_request_query);
    BPS_UCP(ep_create, ucp_ep_create);
    BPS_UCP(ep_close_nbx, ucp_ep_close_nbx);
    BPS_UCP(ep_flush_nbx, ucp_ep_flush_nbx);
    BPS_UCP(stream_send_nbx, ucp_stream_send_nbx);
    BPS_UCP(stream_recv_nbx, ucp_stream_recv_nbx);
    BPS_UCP(tag_send_nbx, ucp_tag_send_nbx);
    BPS_UCP(tag_recv_nbx, ucp_tag_recv_nbx);
    BPS_UCP(request_check_status, ucp_request_check_status);
    BPS_UCP(request_free, ucp_request_free);
    BPS_UCP(request_cancel, ucp_request_cancel);
    BPS_UCP(status_string, ucs_status_string);
    BPS_UCP(get_version, ucp_get_version);
#undef BPS_UCP
  });
  if (!failure.empty()) throw Error(Error::kConfig, failure);
  return api;
}

std::string Why(const UcpApi& api, ucs_status_t st) { return api.status_string(st); }

namespace {
std::mutex contexts_mu;

// Settings UCX reads from the environment only, set (where the user has not) while a
// context and its worker start -- UCX reads its TCP transport's and connection manager's
// settings when the worker opens them -- and unset after, so that processes this one
// starts (a user's subprocess, a launcher's children) do not inherit them as their own.
class ScopedEnvDefaults {
 public:
  void Set(const char* name, const std::string& value) {
    if (getenv(name) != nullptr) return;  // the user's value is kept, and stays
    setenv(name, value.c_str(), /*overwrite=*/0);
    set_.push_back(name);
  }
  ~ScopedEnvDefaults() {
    for (const char* name : set_) unsetenv(name);
  }

 private:
  std::vector<const char*> set_;
};
std::vector<UcxContext*> contexts;  // every context made, for the exit hook

void ExitHook() {
  std::lock_guard<std::mutex> lk(contexts_mu);
  for (UcxContext* c : contexts) c->Stop();  // before libucs' own destructors run
}
}  // namespace

UcxContext::UcxContext(const std::string& tls) : api(UcpApi::Get()) {
  ucp_config_t* config = nullptr;
  ucs_status_t st = api.config_read(nullptr, nullptr, &config);
  if (st != UCS_OK) throw Error(Error::kConfig, "transport ucx: UCX cannot read its configuration: " + Why(api, st));
  if (!tls.empty()) st = api.config_modify(config, "TLS", tls.c_str());
  if (st != UCS_OK) {
    api.config_release(config);
    throw Error(Error::kConfig, "transport ucx:" + tls + ": UCX refuses TLS=" + tls + ": " + Why(api, st));
  }
  unsigned major = 0, minor = 0, release = 0;
  api.get_version(&major, &minor, &release);
  if (RulesFor(major, minor, getenv("UCX_PROTO_ENABLE"), getenv("UCX_RNDV_THRESH"), tls).eager_bodies)
    api.config_modify(config, "RNDV_THRESH", "inf");
  // The worker is shared by every I/O thread (UCS_THREAD_MODE_MULTI), and UCX guards it
  // with a spinlock by default: threads posting sends spin while the progress thread
  // works, and on few cores they spin on a holder that is not even running (emulated 4x4
  // hosts at 800 Mbit/s, 64 MB, two cores: 38% of all CPU in pthread_spin_lock, 1.73 s;
  // with a mutex 0.80 s). A user's UCX_USE_MT_MUTEX is kept.
  if (getenv("UCX_USE_MT_MUTEX") == nullptr) api.config_modify(config, "USE_MT_MUTEX", "y");
  ScopedEnvDefaults env;  // until the worker has started (below)
  // As TCP listeners do (SO_REUSEADDR): a scheduler that serves one job after another
  // listens again on its port while the last job's connections linger in TIME_WAIT. A
  // setting of UCX's TCP connection manager.
  env.Set("UCX_TCP_CM_REUSEADDR", "y");
  // UCX's TCP sockets get the TCP transport's small kernel send buffer (kProbeSendBuffer,
  // what its auto rule gives an 800 Mbit/s link shared by four peers), for the same reason:
  // with autotuned megabytes per socket the engine's credit and partition order only
  // decide what waits in kernel buffers. Emulated 4x4 hosts at 800 Mbit/s, 64 MB: 0.77-0.83
  // of the bound autotuned, 0.86-0.87 with 128 KiB; one host, flat 64 MB: 192-200 ms ->
  // 155-163 ms. UCX fixes it for every socket when the context starts, before any link is
  // measured, so a long fat link (one rtt of more than ~1 ms at full rate) wants a larger
  // UCX_TCP_SNDBUF of the user's, which is kept.
  env.Set("UCX_TCP_SNDBUF", std::to_string(kProbeSendBuffer));
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_TAG | UCP_FEATURE_STREAM | UCP_FEATURE_WAKEUP;
  st = api.init_version(UCP_API_MAJOR, UCP_API_MINOR, &params, config, &context_);
  api.config_release(config);
  if (st != UCS_OK)
    throw Error(Error::kConfig, "transport ucx: UCX failed to start (" + Why(api, st) +
                                    (tls.empty() ? std::string(")") : "; UCX_TLS=" + tls + ")"));
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_MULTI;
  st = api.worker_create(context_, &wp, &worker_);
  if (st != UCS_OK) throw Error(Error::kConfig, "transport ucx: cannot create a UCP worker: " + Why(api, st));
  ucp_worker_attr_t attr{};
  attr.field_mask = UCP_WORKER_ATTR_FIELD_THREAD_MODE;
  if (api.worker_query(worker_, &attr) != UCS_OK || attr.thread_mode != UCS_THREAD_MODE_MULTI)
    throw Error(Error::kConfig, "transport ucx: this UCX was built without multi-thread support "
                                "(configure --enable-mt); bpstrain's I/O threads share one worker");
  int efd = -1;
  st = api.worker_get_efd(worker_, &efd);
  if (st != UCS_OK) throw Error(Error::kConfig, "transport ucx: no wakeup descriptor: " + Why(api, st));
  thread_ = StartThread([this, efd] { ProgressLoop(efd); });
}

void UcxContext::ProgressLoop(int efd) {
  while (!stop_.load()) {
    if (api.worker_progress(worker_)) continue;
    const ucs_status_t st = api.worker_arm(worker_);
    if (st == UCS_ERR_BUSY) continue;  // events came in meanwhile: progress them
    pollfd p{efd, POLLIN, 0};
    // 1 ms bounds a wakeup that the descriptor misses: with 100 ms, 64 MB push_pulls
    // (flat, 2 workers, 2 servers, one 2-core host) took 1-8 s instead of 0.3-0.4 s.
    // Spinning 200 us after progress instead was slower still on 2 shared cores.
    poll(&p, 1, 1);
  }
}

UcxContext* ContextFor(const std::string& tls) {
  static std::map<std::string, UcxContext*> made;
  std::lock_guard<std::mutex> lk(contexts_mu);
  auto it = made.find(tls);
  if (it != made.end()) return it->second;
  auto* ctx = new UcxContext(tls);  // never freed: see UcxContext
  if (contexts.empty()) std::atexit(ExitHook);
  contexts.push_back(ctx);
  return made[tls] = ctx;
}

}  // namespace ucx
}  // namespace bps

#endif  // BPS_HAVE_UCX
