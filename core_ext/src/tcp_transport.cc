#include "tcp_transport.h"

#include <arpa/inet.h>
#include <cerrno>
#include <cstring>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <thread>
#include <unistd.h>

namespace bps {

namespace {

void TuneSocket(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one);
}

}  // namespace

bool ResolveIPv4(const std::string& host, int port, sockaddr_in* out) {
  std::memset(out, 0, sizeof *out);
  out->sin_family = AF_INET;
  out->sin_port = htons(static_cast<uint16_t>(port));
  if (host.empty() || host == "0.0.0.0") {
    out->sin_addr.s_addr = htonl(INADDR_ANY);
    return true;
  }
  if (inet_pton(AF_INET, host.c_str(), &out->sin_addr) == 1) return true;
  addrinfo hints{}, *res = nullptr;
  hints.ai_family = AF_INET;
  if (getaddrinfo(host.c_str(), nullptr, &hints, &res) != 0 || !res) return false;
  out->sin_addr = reinterpret_cast<sockaddr_in*>(res->ai_addr)->sin_addr;
  freeaddrinfo(res);
  return true;
}

TcpListener::TcpListener(const std::string& host, int port) {
  host_ = host == "0.0.0.0" ? "" : host;
  sockaddr_in addr;
  if (!ResolveIPv4(host, port, &addr))
    throw Error(Error::kConfig, "cannot resolve listen address. Received: host=" + host);
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) throw Error(Error::kGeneric, std::string("socket(): ") + strerror(errno));
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    int e = errno;
    close(fd);
    throw Error(Error::kConfig, "cannot listen on " + host + ":" + std::to_string(port) + ": " + strerror(e) +
                                    (e == EADDRNOTAVAIL ? " (not an address of this host: set BPSTRAIN_LISTEN_HOST to one "
                                                          "that is, or to 0.0.0.0 for every interface)"
                                                        : " (is the port in use?)"));
  }
  listen(fd, 512);
  socklen_t len = sizeof addr;
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  port_ = ntohs(addr.sin_port);
  fd_ = fd;
}

TcpListener::~TcpListener() { Close(); }

void TcpListener::Close() {
  int fd = fd_.exchange(-1);
  if (fd >= 0) {
    shutdown(fd, SHUT_RDWR);
    close(fd);
  }
}

std::unique_ptr<Link> TcpListener::Accept() {
  for (;;) {
    int lfd = fd_.load();
    if (lfd < 0) return nullptr;
    sockaddr_in addr;
    socklen_t len = sizeof addr;
    int fd = accept4(lfd, reinterpret_cast<sockaddr*>(&addr), &len, SOCK_CLOEXEC);
    if (fd >= 0) {
      TuneSocket(fd);
      char buf[INET_ADDRSTRLEN] = {0};
      inet_ntop(AF_INET, &addr.sin_addr, buf, sizeof buf);
      return std::make_unique<TcpLink>(fd, buf, buf);
    }
    if (errno == EINTR || errno == ECONNABORTED) continue;
    if (fd_.load() < 0) return nullptr;
    if (errno == EMFILE || errno == ENFILE) {  // out of fds: back off instead of spinning
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      continue;
    }
    return nullptr;
  }
}

void SplitHostPort(const std::string& endpoint, std::string* host, int* port) {
  const size_t colon = endpoint.rfind(':');
  char* end = nullptr;
  long p = colon == std::string::npos ? -1 : std::strtol(endpoint.c_str() + colon + 1, &end, 10);
  if (colon == std::string::npos || !end || *end || p < 0 || p > 65535)
    throw Error(Error::kConfig, "a TCP endpoint is host:port. Received: " + endpoint);
  *host = endpoint.substr(0, colon);
  *port = static_cast<int>(p);
}

std::string TcpTransport::CompleteEndpoint(const std::string& endpoint, const std::string& node_host) const {
  std::string host;
  int port = 0;
  SplitHostPort(endpoint, &host, &port);
  return node_host + ":" + std::to_string(port);
}

std::string TcpTransport::LocalHostToward(const std::string& endpoint) const {
  std::string host;
  int port = 0;
  SplitHostPort(endpoint, &host, &port);
  sockaddr_in addr;
  if (!ResolveIPv4(host, port == 0 ? 9 : port, &addr)) return "";
  // A UDP "connect" sends nothing; it only asks the kernel which source address it would use.
  int fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return "";
  std::string out;
  sockaddr_in local{};
  socklen_t len = sizeof local;
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0) {
    char buf[INET_ADDRSTRLEN] = {0};
    inet_ntop(AF_INET, &local.sin_addr, buf, sizeof buf);
    out = buf;
  }
  close(fd);
  return out == "0.0.0.0" ? "" : out;
}

std::unique_ptr<Link> TcpTransport::Connect(const std::string& endpoint, double deadline_s,
                                            const std::atomic<bool>* cancel) {
  std::string host;
  int port = 0;
  SplitHostPort(endpoint, &host, &port);
  sockaddr_in addr;
  if (!ResolveIPv4(host, port, &addr))
    throw Error(Error::kConfig, "cannot resolve address. Received: host=" + host);
  auto start = Clock::now();
  int last_errno = 0;
  for (int attempt = 0;; ++attempt) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) throw Error(Error::kGeneric, std::string("socket(): ") + strerror(errno));
    if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0) {
      TuneSocket(fd);
      return std::make_unique<TcpLink>(fd, endpoint, host);
    }
    last_errno = errno;
    close(fd);
    if ((cancel && cancel->load()) || SecondsSince(start) > deadline_s)
      throw Error(Error::kTimeout, "could not connect to " + host + ":" + std::to_string(port) +
                                       " within " + std::to_string(static_cast<int>(deadline_s)) +
                                       " s (" + strerror(last_errno) +
                                       "); is the scheduler/server running and reachable?");
    std::this_thread::sleep_for(std::chrono::milliseconds(attempt < 20 ? 50 : 200));
  }
}

TcpLink::TcpLink(int fd, std::string peer, std::string peer_host) : fd_(fd) {
  peer_ = std::move(peer);
  peer_host_ = std::move(peer_host);
  // A peer that stops reading must not hold a sender forever (see kSendTimeoutS).
  timeval tv{static_cast<time_t>(kSendTimeoutS), 0};
  setsockopt(fd_, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
}

TcpLink::~TcpLink() {
  Shutdown();
  close(fd_);
}

void TcpLink::Shutdown() {
  if (!down_.exchange(true)) shutdown(fd_, SHUT_RDWR);
}

void TcpLink::SetRecvTimeout(double seconds) {
  recv_timeout_s_ = seconds;
  ApplyRecvTimeout(seconds);
}

void TcpLink::SetDeadline(double seconds) {
  deadline_ = seconds > 0 ? Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                               std::chrono::duration<double>(seconds))
                          : Clock::time_point{};
  if (seconds <= 0) ApplyRecvTimeout(recv_timeout_s_);
}

void TcpLink::ApplyRecvTimeout(double seconds) {
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(seconds);
  tv.tv_usec = static_cast<suseconds_t>((seconds - tv.tv_sec) * 1e6);
  setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
}

void TcpLink::SetSendBuffer(int bytes) {
  setsockopt(fd_, SOL_SOCKET, SO_SNDBUF, &bytes, sizeof bytes);
}

void TcpLink::Send(FrameHeader h, const std::string& meta, const void* body,
                      uint64_t body_len) {
  h.magic = kFrameMagic;
  h.meta_len = static_cast<uint32_t>(meta.size());
  h.body_len = body_len;
  iovec iov[3] = {{&h, sizeof h},
                  {const_cast<char*>(meta.data()), meta.size()},
                  {const_cast<void*>(body), static_cast<size_t>(body_len)}};
  int idx = 0;
  std::lock_guard<std::mutex> lk(send_mu_);
  while (idx < 3) {
    if (iov[idx].iov_len == 0) {
      ++idx;
      continue;
    }
    msghdr msg{};
    msg.msg_iov = iov + idx;
    msg.msg_iovlen = 3 - idx;
    ssize_t n = sendmsg(fd_, &msg, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK)
        throw Error(Error::kTimeout, "sending to " + peer_ + " made no progress for " +
                                         std::to_string(static_cast<int>(kSendTimeoutS)) + " s (peer stopped reading)");
      throw Error(Error::kPeer, "connection to " + peer_ + " lost while sending: " +
                                    strerror(errno));
    }
    size_t left = static_cast<size_t>(n);
    while (idx < 3 && left >= iov[idx].iov_len) {
      left -= iov[idx].iov_len;
      ++idx;
    }
    if (idx < 3) {
      iov[idx].iov_base = static_cast<char*>(iov[idx].iov_base) + left;
      iov[idx].iov_len -= left;
    }
  }
}

bool TcpLink::RecvAll(void* dst, uint64_t n, bool eof_ok) {
  char* p = static_cast<char*>(dst);
  uint64_t got = 0;
  const bool bounded = deadline_ != Clock::time_point{};
  while (got < n) {
    if (bounded) {  // the deadline bounds the whole receive, not each recv() call
      const double left = std::chrono::duration<double>(deadline_ - Clock::now()).count();
      if (left <= 0) throw Error(Error::kTimeout, "receive from " + peer_ + " missed its deadline");
      ApplyRecvTimeout(recv_timeout_s_ > 0 ? std::min(left, recv_timeout_s_) : left);
    }
    ssize_t r = recv(fd_, p + got, static_cast<size_t>(std::min<uint64_t>(n - got, 1 << 30)), 0);
    if (r > 0) {
      got += static_cast<uint64_t>(r);
      continue;
    }
    if (r < 0 && errno == EINTR) continue;
    if (r == 0 && got == 0 && eof_ok) return false;
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
      throw Error(Error::kTimeout, "receive from " + peer_ + " timed out");
    throw Error(Error::kPeer, "connection to " + peer_ + " closed" +
                                  (r < 0 ? std::string(": ") + strerror(errno)
                                         : std::string(" mid-frame")));
  }
  return true;
}

bool TcpLink::RecvFrame(FrameHeader* h, std::string* meta, uint64_t max_body, uint32_t max_meta) {
  if (!RecvAll(h, sizeof *h, /*eof_ok=*/true)) return false;
  CheckHeader(*h, max_body, max_meta);
  meta->resize(h->meta_len);
  if (h->meta_len) RecvAll(&(*meta)[0], h->meta_len, false);
  return true;
}

void TcpLink::RecvBody(void* dst, uint64_t n) { RecvAll(dst, n, false); }

void TcpLink::DiscardBody(uint64_t n) {
  char buf[65536];
  while (n) {
    uint64_t k = std::min<uint64_t>(n, sizeof buf);
    RecvAll(buf, k, false);
    n -= k;
  }
}

}  // namespace bps
