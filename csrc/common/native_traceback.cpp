#include "common/native_traceback.h"

#include <dlfcn.h>
#include <execinfo.h>
#include <signal.h>
#include <unistd.h>

#include <cstddef>
#include <cstdio>
#include <cstring>

namespace dualpipe {
namespace {

// Native stack on a fatal signal (DUALPIPE_KERNELS_NATIVE_TRACEBACK=1): Python's
// faulthandler shows only Python frames. The handler writes the faulting
// address and backtrace_symbols_fd's frames (object(+offset), which addr2line
// resolves), then puts the previous handler back and returns: the faulting
// instruction runs again and the previous handler (faulthandler's) reports too.
constexpr int kFatalSignals[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT};
struct sigaction g_previous[sizeof kFatalSignals / sizeof kFatalSignals[0]];

void write_str(const char* s) { (void)!::write(2, s, std::strlen(s)); }

void on_fatal_signal(int sig, siginfo_t* info, void*) {
  char line[160];
  std::snprintf(line, sizeof line, "dualpipe_kernels: fatal signal %d at address %p (pid %d); native stack:\n", sig,
                info != nullptr ? info->si_addr : nullptr, static_cast<int>(::getpid()));
  write_str(line);
  void* frames[64];
  backtrace_symbols_fd(frames, backtrace(frames, 64), 2);
  Dl_info self{};
  if (dladdr(reinterpret_cast<void*>(&on_fatal_signal), &self) != 0) {
    std::snprintf(line, sizeof line, "dualpipe_kernels: %s is loaded at %p\n", self.dli_fname, self.dli_fbase);
    write_str(line);
  }
  for (std::size_t i = 0; i < sizeof kFatalSignals / sizeof kFatalSignals[0]; ++i) {
    if (kFatalSignals[i] == sig) sigaction(sig, &g_previous[i], nullptr);
  }
  if (sig == SIGABRT || sig == SIGFPE) raise(sig);  // not re-raised by returning
}

// SIGUSR2 (installed with the above): write the receiving thread's native stack
// and go on. A watchdog sends it to every thread of a stuck process (tgkill).
void on_stack_request(int, siginfo_t*, void*) {
  char line[96];
  std::snprintf(line, sizeof line, "dualpipe_kernels: native stack of thread %ld:\n", static_cast<long>(::gettid()));
  write_str(line);
  void* frames[48];
  backtrace_symbols_fd(frames, backtrace(frames, 48), 2);
}

}  // namespace

bool install_native_traceback() {
  void* warm[2];
  (void)backtrace(warm, 2);  // loads libgcc's unwinder now, not inside the handler
  struct sigaction sa {};
  sa.sa_sigaction = on_fatal_signal;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&sa.sa_mask);
  bool ok = true;
  for (std::size_t i = 0; i < sizeof kFatalSignals / sizeof kFatalSignals[0]; ++i) {
    ok &= sigaction(kFatalSignals[i], &sa, &g_previous[i]) == 0;
  }
  struct sigaction dump {};
  dump.sa_sigaction = on_stack_request;
  dump.sa_flags = SA_SIGINFO | SA_RESTART;
  sigemptyset(&dump.sa_mask);
  ok &= sigaction(SIGUSR2, &dump, nullptr) == 0;
  return ok;
}

}  // namespace dualpipe
