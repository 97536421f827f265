#include "common/liveness.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>

namespace dualpipe {

std::string process_dead_reason(int pid) {
  if (pid <= 0) return "has no valid pid (" + std::to_string(pid) + ")";
  if (::kill(pid, 0) != 0 && errno == ESRCH) return "exited";
  // kill(pid, 0) succeeds for a zombie; /proc tells them apart. The state is the
  // first field after the parenthesised command name (which may hold spaces).
  // (read(2), not std::ifstream: no iostreams in the extension, see common/msg.h)
  const int fd = ::open(("/proc/" + std::to_string(pid) + "/stat").c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return "";  // no /proc: trust kill()
  char buf[512];
  const ssize_t n = ::read(fd, buf, sizeof buf);
  ::close(fd);
  if (n <= 0) return "";
  const std::string line(buf, static_cast<std::size_t>(n));
  const auto close = line.rfind(')');
  if (close == std::string::npos || close + 2 >= line.size()) return "";
  const char state = line[close + 2];
  if (state == 'Z' || state == 'X') return "exited (zombie)";
  return "";
}

}  // namespace dualpipe
