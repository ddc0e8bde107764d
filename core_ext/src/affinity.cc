#include "affinity.h"

#include <pthread.h>
#include <sched.h>

#include <fstream>
#include <sstream>

#include "common.h"

namespace bps {

namespace {
std::string ReadFirstLine(const std::string& path) {
  std::ifstream f(path);
  std::string line;
  if (f) std::getline(f, line);
  return line;
}
const char* kForms = "expected \"off\", \"auto\", \"node:N\" or \"cpus:0-3,8\"";
}  // namespace

std::vector<int> ParseCpuList(const std::string& list) {
  std::vector<int> cpus;
  std::stringstream ss(list);
  std::string part;
  while (std::getline(ss, part, ',')) {
    if (part.empty()) continue;
    size_t dash = part.find('-');
    try {
      int lo = std::stoi(part.substr(0, dash));
      int hi = dash == std::string::npos ? lo : std::stoi(part.substr(dash + 1));
      if (lo < 0 || hi < lo) throw std::invalid_argument("range");
      for (int c = lo; c <= hi; ++c) cpus.push_back(c);
    } catch (const std::exception&) {
      throw Error(Error::kConfig, std::string("malformed CPU list; ") + kForms +
                                      ". Received: " + list);
    }
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
