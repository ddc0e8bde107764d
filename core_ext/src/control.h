// The control-plane client every server and worker uses to talk to the scheduler:
// the secure handshake (secure_link.h), registration (kHello -> kWelcome), heartbeats, and a reader thread that hands every
// later control frame to the owner's callback. Written once, used by both roles, over
// any Transport. Sends are queued (Outbox): a caller holding its own lock never blocks
// on the scheduler.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common.h"
#include "transport.h"

namespace bps {

enum class Role : uint32_t { kScheduler = 0, kServer = 1, kWorker = 2 };
const char* RoleName(Role r);

// What a node says about itself in kHello.
struct NodeInfo {
  Role role = Role::kWorker;
  int64_t rank_hint = -1;      // requested rank/server id, -1 = assign in arrival order
  std::string listen_endpoint;  // servers: their data listener (Listener::endpoint())
  std::string advertise_host;  // "" = the scheduler uses the address it sees
  std::string secret;          // the cluster secret ("" = none); never sent
  int local_size = 1;          // workers: processes on this worker host (BYTEPS_LOCAL_SIZE)
  std::string host_id;         // which machine this is ("" = advertise_host or the address
                               // the scheduler sees); co-located servers share a worker's id
};

// What the scheduler answers in kWelcome.
struct Welcome {
  int64_t rank = -1;
  int num_workers = 0;  // worker processes: worker hosts x local size (a joiner's: up to its rank)
  int num_servers = 0;
  // Fault tolerance: the most worker ranks the job may give out (comm.max_workers; a
  // scale-up adds ranks up to it). A server gets a credential for each; num_workers if
  // the welcome does not say.
  int max_workers = 0;
  std::vector<std::string> servers;  // endpoints, index = server id
  uint64_t job_id = 0;  // random per job: names host-local shared memory
  // Data-connection credentials the scheduler issued: a worker gets one per server, a
  // server one per worker rank up to max_workers (index = the peer's id); secure_link.h.
  std::vector<std::string> peer_keys;
  // comm.fault_tolerance, as the scheduler runs the job (kWelcomeFaultTolerance): a
  // server then keeps serving when the scheduler goes (server.cc, OnSchedulerLost).
  bool fault_tolerance = false;
  bool joining = false;  // kWelcomeJoining: it joins the running job at the next admission
};

// Bits of the welcome's trailing flags word (absent: none).
constexpr uint32_t kWelcomeFaultTolerance = 1;
constexpr uint32_t kWelcomeJoining = 2;  // a worker joining the running job (fault tolerance)

// The largest job the control plane accepts (a welcome beyond it is malformed).
constexpr int kMaxNodes = 1 << 16;

class ControlClient {
 public:
  using Handler = std::function<void(const FrameHeader&, const std::string& meta)>;
  using LostHandler = std::function<void(const std::string& reason)>;

  ControlClient() = default;
  ~ControlClient() { Close(); }

  // Connects (retrying until `timeout_s`), sends kHello and waits for kWelcome. Then
  // starts the reader thread (frames -> `on_frame`, connection loss -> `on_lost`) and a
  // heartbeat thread. Throws Error(kTimeout/kPeer/kConfig) with the reason.
  Welcome Connect(Transport& transport, const std::string& endpoint, const NodeInfo& me, double timeout_s,
                  Handler on_frame, LostHandler on_lost, const std::atomic<bool>* cancel);

  // Queues a frame for the scheduler; never blocks on the network.
  void Send(MsgType type, const std::string& meta = "", uint64_t key = 0, int64_t arg = 0);
  // Sends what is queued (waiting up to `flush_s`), then stops the threads; the
  // connection closes without reporting a loss.
  void Close(double flush_s = 0);

 private:
  // One connection and hello; false when the scheduler answered kRetryLater or closed the
  // connection without a word (both: reconnect until the timeout).
  bool Hello(Transport& transport, const std::string& endpoint, const NodeInfo& me, Clock::time_point start,
             double timeout_s, const std::atomic<bool>* cancel, FrameHeader* r, std::string* meta);
  void ReadLoop();
  void HeartbeatLoop();

  std::shared_ptr<Link> conn_;
  std::unique_ptr<Outbox> outbox_;
  Handler on_frame_;
  LostHandler on_lost_;
  std::atomic<bool> closing_{false};
  std::thread reader_, heartbeat_;
  std::mutex hb_mu_;
  std::condition_variable hb_cv_;
  int64_t my_rank_ = -1;
};

}  // namespace bps
