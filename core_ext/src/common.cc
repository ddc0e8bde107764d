#include "common.h"

#include <cstdlib>
#include <mutex>

namespace bps {

namespace {
const char* kNames[kNumDTypes] = {"float16", "bfloat16", "float32", "float64",
                                  "int8",    "uint8",    "int32",   "int64", "compressed"};
const size_t kSizes[kNumDTypes] = {2, 2, 4, 8, 1, 1, 4, 8, 1};

std::mutex g_log_mu;
std::string g_log_prefix = "bpstrain";

LogLevel ThresholdFromEnv() {
  const char* v = std::getenv("BPSTRAIN_LOG_LEVEL");
  if (!v) return LogLevel::kWarn;
  std::string s(v);
  if (s == "debug") return LogLevel::kDebug;
  if (s == "info") return LogLevel::kInfo;
  if (s == "error") return LogLevel::kError;
  return LogLevel::kWarn;
}
}  // namespace

bool ValidDType(int code) { return code >= 0 && code < kNumDTypes; }
size_t DTypeSize(DType t) { return kSizes[static_cast<int>(t)]; }
const char* DTypeName(DType t) { return kNames[static_cast<int>(t)]; }

DType ParseDType(const std::string& name) {
  for (int i = 0; i < kNumDTypes; ++i)
    if (name == kNames[i]) return static_cast<DType>(i);
  throw Error(Error::kConfig,
              "unsupported dtype; expected one of float16, bfloat16, float32, float64, "
              "int8, uint8, int32, int64, compressed. Received: dtype=" + name);
}

void SetLogPrefix(const std::string& prefix) {
  std::lock_guard<std::mutex> lk(g_log_mu);
  g_log_prefix = prefix;
}

void LogMessage(LogLevel level, const std::string& msg) {
  static const LogLevel threshold = ThresholdFromEnv();
  if (level < threshold) return;
  static const char* tags[] = {"debug", "info", "warning", "error"};
  std::lock_guard<std::mutex> lk(g_log_mu);
  std::fprintf(stderr, "[%s %s] %s\n", g_log_prefix.c_str(), tags[static_cast<int>(level)],
               msg.c_str());
  std::fflush(stderr);
}

AsyncSignalsBlocked::AsyncSignalsBlocked() {
  sigset_t block;
  sigemptyset(&block);
  for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2, SIGALRM}) sigaddset(&block, sig);
  pthread_sigmask(SIG_BLOCK, &block, &old_);
}

AsyncSignalsBlocked::~AsyncSignalsBlocked() { pthread_sigmask(SIG_SETMASK, &old_, nullptr); }

std::string ShapeString(const std::vector<int64_t>& shape) {
  // Plain std::to_string, no iostreams: an ostringstream formats through the process's
  // std::locale, and where the extension's libstdc++ headers differ from the runtime
  // library loaded first (seen on the GPU machine, Python 3.12) that crashed the scheduler.
  std::string out = "(";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(shape[i]);
  }
  if (shape.size() == 1) out += ",";
  return out + ")";
}

}  // namespace bps
