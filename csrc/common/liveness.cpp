#include "common/liveness.h"

#include <signal.h>

#include <cerrno>
#include <fstream>
#include <sstream>

namespace dualpipe {

std::string process_dead_reason(int pid) {
  if (pid <= 0) return "has no valid pid (" + std::to_string(pid) + ")";
  if (::kill(pid, 0) != 0 && errno == ESRCH) return "exited";
  // kill(pid, 0) succeeds for a zombie; /proc tells them apart. The state is the
  // first field after the parenthesised command name (which may hold spaces).
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  if (!stat) return "";  // no /proc: trust kill()
  std::string line;
  std::getline(stat, line);
  const auto close = line.rfind(')');
  if (close == std::string::npos || close + 2 >= line.size()) return "";
  const char state = line[close + 2];
  if (state == 'Z' || state == 'X') return "exited (zombie)";
  return "";
}

}  // namespace dualpipe
