#include "local_group.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "affinity.h"
#include "reduce.h"

namespace bps {

namespace {

constexpr size_t kLine = 64;
constexpr double kOpenTimeout = 60.0;

size_t RoundUp(size_t n) { return (n + kLine - 1) / kLine * kLine; }

std::string Hex(uint64_t v) {
  char b[17];
  std::snprintf(b, sizeof b, "%016llx", static_cast<unsigned long long>(v));
  return b;
}

uint64_t Fnv(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

struct Header {  // first cache line of every segment
  std::atomic<uint64_t> ready;
  std::atomic<uint64_t> opened;
  uint64_t nbytes;
  uint32_t dtype;
  uint32_t local_size;
};
static_assert(sizeof(Header) <= kLine, "header fits one line");

// Maps a host-wide segment, creating it if this process is first. The last of the
// `users` processes to open it unlinks the name, so nothing outlives the job.
char* MapShared(const std::string& name, size_t size, int users, uint64_t nbytes, DType dtype) {
  bool created = false;
  int fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  if (fd >= 0) {
    created = true;
    if (ftruncate(fd, static_cast<off_t>(size)) != 0) {
      int e = errno;
      close(fd);
      shm_unlink(name.c_str());
      throw Error(Error::kGeneric, "cannot size shared memory " + name + ": " + strerror(e) +
                                       " (is /dev/shm large enough?)");
    }
  } else if (errno == EEXIST) {
    fd = shm_open(name.c_str(), O_RDWR | O_NOFOLLOW, 0600);
    struct stat st {};
    // Another local rank made it - or someone else did, to read or feed this host's sums.
    if (fd >= 0 && fstat(fd, &st) == 0 && (st.st_uid != geteuid() || (st.st_mode & 077) != 0)) {
      close(fd);
      throw Error(Error::kGeneric, "shared memory " + name + " exists but belongs to uid " + std::to_string(st.st_uid) +
                                       " with mode " + std::to_string(st.st_mode & 0777) +
                                       ": refusing to use a segment this user did not create with mode 0600");
    }
    auto start = Clock::now();
    while (fd >= 0 && fstat(fd, &st) == 0 && st.st_size == 0 && SecondsSince(start) < kOpenTimeout)
      usleep(200);
    if (fd < 0 || st.st_size == 0) throw Error(Error::kTimeout, "shared memory " + name + " was never sized");
    if (static_cast<size_t>(st.st_size) != size) {
      close(fd);
      throw Error(Error::kMismatch, "a process on this host uses the tensor with another size or dtype "
                                    "(its shared segment has " + std::to_string(st.st_size) +
                                    " bytes, this rank needs " + std::to_string(size) + ")");
    }
  } else {
    throw Error(Error::kGeneric, "shm_open(" + name + "): " + strerror(errno));
  }
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) throw Error(Error::kGeneric, "mmap of shared memory " + name + " failed");
  auto* h = static_cast<Header*>(p);
  if (created) {
    h->nbytes = nbytes;
    h->dtype = static_cast<uint32_t>(dtype);
    h->local_size = static_cast<uint32_t>(users);
    h->ready.store(1, std::memory_order_release);
  } else {
    auto start = Clock::now();
    while (h->ready.load(std::memory_order_acquire) != 1 && SecondsSince(start) < kOpenTimeout) usleep(100);
    if (h->nbytes != nbytes || h->dtype != static_cast<uint32_t>(dtype)) {
      std::string msg = std::string("ranks on this host disagree: another local rank declared ") +
                        DTypeName(static_cast<DType>(h->dtype)) + " of " + std::to_string(h->nbytes) +
                        " bytes, this rank " + DTypeName(dtype) + " of " + std::to_string(nbytes) + " bytes";
      munmap(p, size);
      throw Error(Error::kMismatch, msg);
    }
  }
  if (static_cast<int>(h->opened.fetch_add(1) + 1) == users) shm_unlink(name.c_str());
  return static_cast<char*>(p);
}

void FutexWait(std::atomic<uint32_t>* addr, uint32_t seen, long nanos) {
  timespec ts{0, nanos};
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), FUTEX_WAIT, seen, &ts, nullptr, 0);
}

void FutexWakeAll(std::atomic<uint32_t>* addr) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

}  // namespace

struct LocalGroup::Segment {
  char* base = nullptr;
  size_t size = 0;
  uint64_t nbytes = 0;
  DType dtype = DType::kFloat32;
  int generation = 0;  // how many times this rank saw the name declared again
  int users = 0;       // ops of this rank not finished with it
  size_t stride = 0;  // bytes per slot, cache-line aligned
  int local_size = 0;
  uint64_t next_round = 0;

  std::atomic<uint64_t>& Seq(int which, int k) {  // which: 0 arrived, 1 sliced, 2 released
    return *reinterpret_cast<std::atomic<uint64_t>*>(base + kLine * (1 + 3 * k + which));
  }
  char* Slot(int k) { return base + kLine * (1 + 3 * local_size) + stride * k; }
  char* Result() { return Slot(local_size); }
  bool All(int which, uint64_t v) {
    for (int k = 0; k < local_size; ++k)
      if (Seq(which, k).load(std::memory_order_acquire) < v) return false;
    return true;
  }
  ~Segment() {
    if (base) munmap(base, size);
  }
};

struct LocalGroup::PendingOp {
  int64_t handle;
  OpRequest req;
  Segment* seg = nullptr;
  uint64_t round = 0;
  int state = 0;
  int64_t sub = -1;
  size_t slice_off = 0, slice_len = 0;  // bytes
  int64_t reduced_us = 0;                // this rank's slice is reduced (timeline)
};

LocalGroup::LocalGroup(const Layout& layout, Hooks hooks, std::vector<int> cpus)
    : layout_(layout), hooks_(std::move(hooks)), cpus_(std::move(cpus)) {
  std::string name = "/bps" + Hex(layout.job_id) + "h" + std::to_string(layout.host) + "bell";
  bell_map_ = MapShared(name, kLine * 2, layout.local_size, 0, DType::kUInt8);
  bell_ = reinterpret_cast<std::atomic<uint32_t>*>(static_cast<char*>(bell_map_) + kLine);
  thread_ = StartThread([this] { Loop(); });
}

LocalGroup::~LocalGroup() {
  Stop();
  if (bell_map_) munmap(bell_map_, kLine * 2);
}

void LocalGroup::Stop() {
  if (stop_.exchange(true)) return;
  Ring();
  if (thread_.joinable()) thread_.join();
}

void LocalGroup::Ring() {
  bell_->fetch_add(1, std::memory_order_acq_rel);
  FutexWakeAll(bell_);
}

void LocalGroup::Submit(int64_t handle, const OpRequest& req, uint64_t ticket) {
  auto op = std::make_unique<PendingOp>();
  op->handle = handle;
  op->req = req;
  {
    std::lock_guard<std::mutex> lk(mu_);
    pending_[ticket] = std::move(op);
  }
  Ring();
}

LocalGroup::Segment& LocalGroup::SegmentFor(const OpRequest& req) {
  int64_t elems = 1;
  for (int64_t d : req.shape) elems *= d;
  const uint64_t nbytes = static_cast<uint64_t>(elems) * DTypeSize(req.dtype);
  auto it = segments_.find(req.name);
  int generation = 0;
  if (it != segments_.end()) {
    if (it->second->nbytes == nbytes && it->second->dtype == req.dtype) return *it->second;
    // Declared again with another size or dtype: every rank agreed with the scheduler
    // before the op got here, and every local rank does it in the same order, so each
    // moves to the next generation's segment. The old one stays mapped until this
    // rank's ops on it finish.
    generation = it->second->generation + 1;
    retired_.push_back(std::move(it->second));
    segments_.erase(it);
  }
  auto seg = std::make_unique<Segment>();
  seg->nbytes = nbytes;
  seg->dtype = req.dtype;
  seg->generation = generation;
  seg->local_size = layout_.local_size;
  seg->stride = RoundUp(std::max<uint64_t>(nbytes, 1));
  seg->size = kLine * (1 + 3 * layout_.local_size) + seg->stride * (layout_.local_size + 1);
  std::string name = "/bps" + Hex(layout_.job_id) + "h" + std::to_string(layout_.host) + "t" + Hex(Fnv(req.name)) +
                     "g" + std::to_string(generation);
  seg->base = MapShared(name, seg->size, layout_.local_size, nbytes, req.dtype);
  return *(segments_[req.name] = std::move(seg));
}

void LocalGroup::Loop() {
  SetupEngineThread("bps-local", cpus_);
  std::list<std::unique_ptr<PendingOp>> active;
  while (!stop_.load()) {
    uint32_t seen = bell_->load(std::memory_order_acquire);
    {
      std::lock_guard<std::mutex> lk(mu_);
      // Rounds are handed out below in list order: admit only the next tickets in order.
      for (auto it = pending_.begin(); it != pending_.end() && it->first == next_ticket_;
           it = pending_.erase(it), ++next_ticket_)
        active.push_back(std::move(it->second));
    }
    bool progress = false;
    for (auto it = active.begin(); it != active.end();) {
      PendingOp& op = **it;
      try {
        if (!op.seg) {
          op.seg = &SegmentFor(op.req);
          op.round = op.seg->next_round++;
          ++op.seg->users;
        }
        progress |= Advance(op);
      } catch (const Error& e) {
        hooks_.complete(op.handle, e.kind(), "tensor '" + op.req.name + "': " + e.what(), op.reduced_us);
        op.state = 4;
        progress = true;
      }
      if (op.state == 4 && op.seg) --op.seg->users;
      it = op.state == 4 ? active.erase(it) : std::next(it);
    }
    retired_.erase(std::remove_if(retired_.begin(), retired_.end(),
                                  [](const std::unique_ptr<Segment>& s) { return s->users == 0; }),
                   retired_.end());
    if (!progress) FutexWait(bell_, seen, active.empty() ? 50'000'000 : 2'000'000);
  }
  for (auto& op : active) hooks_.complete(op->handle, Error::kShutdown, "shut down during a hierarchical push_pull", 0);
}

bool LocalGroup::Advance(PendingOp& op) {
  Segment& s = *op.seg;
  const int me = layout_.local_rank, L = layout_.local_size;
  const OpRequest& req = op.req;
  const size_t esize = DTypeSize(req.dtype);
  const uint64_t r = op.round;
  bool progress = false;
  if (op.state == 0) {
    if (!s.All(2, r)) return false;  // someone still copies out the previous round
    std::memcpy(s.Slot(me), req.input, s.nbytes);
    s.Seq(0, me).store(r + 1, std::memory_order_release);
    Ring();
    const size_t elems = s.nbytes / esize, per = (elems + L - 1) / L;
    const size_t lo = std::min(elems, per * me), hi = std::min(elems, per * (me + 1));
    op.slice_off = lo * esize;
    op.slice_len = (hi - lo) * esize;
    op.state = 1;
    progress = true;
  }
  if (op.state == 1) {
    if (!s.All(0, r + 1)) return progress;
    const size_t n = op.slice_len / esize;
    char* dst = s.Result() + op.slice_off;
    if (n) {
      if (AccumulatesInFloat(req.dtype)) {
        std::vector<float> acc(n);
        Widen(req.dtype, acc.data(), s.Slot(0) + op.slice_off, n);
        for (int k = 1; k < L; ++k) Accumulate(req.dtype, acc.data(), s.Slot(k) + op.slice_off, n);
        Narrow(req.dtype, dst, acc.data(), n);
      } else {
        std::memcpy(dst, s.Slot(0) + op.slice_off, op.slice_len);
        for (int k = 1; k < L; ++k) SumInto(req.dtype, dst, s.Slot(k) + op.slice_off, n);
      }
    }
    if (layout_.num_hosts > 1 && n) {
      OpRequest sub;
      sub.name = req.name + "/slice" + std::to_string(me);
      sub.dtype = req.dtype;
      sub.shape = {static_cast<int64_t>(n)};
      sub.input = dst;
      sub.output = dst;
      sub.op = Op::kSum;
      sub.priority = req.priority;
      sub.participants = layout_.num_hosts;
      op.sub = hooks_.enqueue(sub);
      op.state = 2;
    } else {
      s.Seq(1, me).store(r + 1, std::memory_order_release);
      Ring();
      op.reduced_us = WallMicros();
      op.state = 3;
    }
    progress = true;
  }
  if (op.state == 2) {
    std::string err;
    Error::Kind kind = Error::kGeneric;
    int st = hooks_.poll(op.sub, &kind, &err);
    if (st == 0) return progress;
    if (st < 0) throw Error(kind, err);
    s.Seq(1, me).store(r + 1, std::memory_order_release);
    Ring();
    op.reduced_us = WallMicros();
    op.state = 3;
    progress = true;
  }
  if (op.state == 3) {
    if (!s.All(1, r + 1)) return progress;
    std::memcpy(req.output, s.Result(), s.nbytes);
    if (req.op == Op::kAverage) DivideInPlace(req.dtype, req.output, s.nbytes / esize, layout_.world_size);
    s.Seq(2, me).store(r + 1, std::memory_order_release);
    Ring();
    hooks_.complete(op.handle, Error::kGeneric, "", op.reduced_us);
    op.state = 4;
    progress = true;
  }
  return progress;
}

}  // namespace bps
