#include "affinity.h"

#include <pthread.h>
#include <sched.h>

#include <cstdio>
#include <cstdlib>

#include "common.h"

namespace bps {

namespace {
// stdio and strtol rather than iostreams: the engine stays off std::locale (see
// ShapeString in common.cc for the crash that caused).
std::string ReadFirstLine(const std::string& path) {
  std::string line;
  if (FILE* f = std::fopen(path.c_str(), "r")) {
    char buf[4096];
    if (std::fgets(buf, sizeof buf, f)) line = buf;
    std::fclose(f);
  }
  while (!line.empty() && (line.back() == '\n' || line.back() == '\r')) line.pop_back();
  return line;
}

// A whole non-negative decimal number, or -1.
int ParseCount(const std::string& text) {
  if (text.empty() || text.size() > 9) return -1;
  char* end = nullptr;
  long v = std::strtol(text.c_str(), &end, 10);
  return (*end == '\0' && text[0] >= '0' && text[0] <= '9') ? static_cast<int>(v) : -1;
}
const char* kForms = "expected \"off\", \"auto\", \"node:N\" or \"cpus:0-3,8\"";
}  // namespace

std::vector<int> ParseCpuList(const std::string& list) {
  std::vector<int> cpus;
  size_t start = 0;
  while (start <= list.size()) {
    size_t comma = list.find(',', start);
    if (comma == std::string::npos) comma = list.size();
    std::string part = list.substr(start, comma - start);
    start = comma + 1;
    if (part.empty()) continue;
    size_t dash = part.find('-');
    int lo = ParseCount(part.substr(0, dash));
    int hi = dash == std::string::npos ? lo : ParseCount(part.substr(dash + 1));
    if (lo < 0 || hi < lo || hi >= (1 << 16))
      throw Error(Error::kConfig, std::string("malformed CPU list; ") + kForms + ". Received: " + list);
    for (int c = lo; c <= hi; ++c) cpus.push_back(c);
  }
  return cpus;
}

int NumaNodeCount() {
  int n = 0;
  while (!ReadFirstLine("/sys/devices/system/node/node" + std::to_string(n) + "/cpulist").empty())
    ++n;
  return n;
}

std::vector<int> ResolveCpuSpec(const std::string& spec, int local_rank) {
  if (spec.empty() || spec == "off") return {};
  if (spec == "auto") {
    int nodes = NumaNodeCount();
    if (nodes <= 1) return {};
    return ResolveCpuSpec("node:" + std::to_string(local_rank % nodes), local_rank);
  }
  if (spec.rfind("node:", 0) == 0) {
    std::string list =
        ReadFirstLine("/sys/devices/system/node/node" + spec.substr(5) + "/cpulist");
    if (list.empty())
      throw Error(Error::kConfig, "NUMA node " + spec.substr(5) + " does not exist on this machine (" +
                                      std::to_string(NumaNodeCount()) + " nodes). Received: numa=" + spec);
    return ParseCpuList(list);
  }
  if (spec.rfind("cpus:", 0) == 0) return ParseCpuList(spec.substr(5));
  throw Error(Error::kConfig, std::string("unknown NUMA spec; ") + kForms + ". Received: numa=" + spec);
}

void SetupEngineThread(const std::string& name, const std::vector<int>& cpus) {
  pthread_setname_np(pthread_self(), name.substr(0, 15).c_str());
  if (cpus.empty()) return;
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int c : cpus)
    if (c < CPU_SETSIZE) CPU_SET(c, &set);
  if (pthread_setaffinity_np(pthread_self(), sizeof set, &set) != 0)
    LogWarn("could not pin thread " + name + " to the requested CPUs; running unpinned");
}

}  // namespace bps
