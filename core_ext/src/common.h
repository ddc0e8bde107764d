// Shared vocabulary of the engine: dtypes, the error type that travels to Python,
// logging, and small time helpers.
//
// Nothing in the engine ends the process on bad input: every failure is a bps::Error with a
// Kind that the bindings map to one Python exception class (bindings/module.cc).
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <signal.h>

namespace bps {

// Element types understood by the wire protocol and the summation kernels.
// The numeric values travel on the wire: never reorder.
enum class DType : uint8_t {
  kFloat16 = 0,
  kBFloat16 = 1,
  kFloat32 = 2,
  kFloat64 = 3,
  kInt8 = 4,
  kUInt8 = 5,
  kInt32 = 6,
  kInt64 = 7,
  kCompressed = 8,  // bytes of compressed blobs (codec.h): decoded and re-encoded, never summed raw
};
constexpr int kNumDTypes = 9;

size_t DTypeSize(DType t);
const char* DTypeName(DType t);
// Parses "float32" etc. Throws Error(kConfig) naming the accepted spellings.
DType ParseDType(const std::string& name);
bool ValidDType(int code);

// The one exception type of the engine. `kind` selects the Python class.
class Error : public std::runtime_error {
 public:
  enum Kind {
    kGeneric = 0,   // -> bpstrain.errors.BpsError
    kMismatch = 1,  // cross-rank shape/dtype disagreement -> MismatchError
    kPeer = 2,      // a peer died or closed its connection -> PeerError
    kTimeout = 3,   // a wait ran past its deadline -> BpsTimeoutError
    kConfig = 4,    // bad option/environment -> ConfigError (ValueError)
    kShutdown = 5,  // the engine was shut down while waiting -> BpsError
  };
  Error(Kind kind, const std::string& msg) : std::runtime_error(msg), kind_(kind) {}
  Kind kind() const { return kind_; }

 private:
  Kind kind_;
};

// Logging goes to stderr with a role prefix; the launcher adds its own rank prefix.
enum class LogLevel { kDebug = 0, kInfo = 1, kWarn = 2, kError = 3 };
void SetLogPrefix(const std::string& prefix);
void LogMessage(LogLevel level, const std::string& msg);
inline void LogWarn(const std::string& m) { LogMessage(LogLevel::kWarn, m); }
inline void LogInfo(const std::string& m) { LogMessage(LogLevel::kInfo, m); }
inline void LogDebug(const std::string& m) { LogMessage(LogLevel::kDebug, m); }

using Clock = std::chrono::steady_clock;
// Wall-clock microseconds (system_clock): timestamps of the communication timeline.
inline int64_t WallMicros() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::system_clock::now().time_since_epoch()).count();
}
inline double SecondsSince(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

std::string ShapeString(const std::vector<int64_t>& shape);

// Blocks the asynchronous signals (SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2,
// SIGALRM) in the calling thread while alive and restores the mask after.
class AsyncSignalsBlocked {
 public:
  AsyncSignalsBlocked();
  ~AsyncSignalsBlocked();
  AsyncSignalsBlocked(const AsyncSignalsBlocked&) = delete;
  AsyncSignalsBlocked& operator=(const AsyncSignalsBlocked&) = delete;

 private:
  sigset_t old_;
};

// Every engine thread starts here. A process-directed signal goes to any thread that
// does not block it; landing on an engine thread, CPython only sets a flag, and the main
// thread, blocked in a wait, never runs its handler (a launcher's SIGUSR1 or SIGTERM, a
// Ctrl-C). Threads started with these signals blocked leave them all to Python's thread;
// threads they start inherit the mask.
template <class F>
std::thread StartThread(F&& fn) {
  AsyncSignalsBlocked blocked;
  return std::thread(std::forward<F>(fn));
}

}  // namespace bps
