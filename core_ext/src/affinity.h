// CPU/NUMA placement of engine threads.
//
// Spec strings (comm.numa / BPSTRAIN_NUMA):
//   "off"        leave threads where the OS puts them
//   "auto"       on a machine with several NUMA nodes, pin to node (local_rank % nodes);
//                on a single-node machine, do nothing
//   "node:N"     the CPUs of NUMA node N (from /sys/devices/system/node/nodeN/cpulist)
//   "cpus:0-3,8" an explicit CPU list
#pragma once

#include <string>
#include <vector>

namespace bps {

// Resolves a spec to a CPU list; empty means "do not pin". Throws Error(kConfig) on a
// malformed spec, naming the accepted forms.
std::vector<int> ResolveCpuSpec(const std::string& spec, int local_rank);
std::vector<int> ParseCpuList(const std::string& list);  // "0-3,8" -> {0,1,2,3,8}
int NumaNodeCount();

// Names the calling thread (visible in /proc/<pid>/task/<tid>/comm, max 15 chars) and
// pins it to `cpus` when non-empty. Pinning failures are logged, never fatal.
void SetupEngineThread(const std::string& name, const std::vector<int>& cpus);

}  // namespace bps
