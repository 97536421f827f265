// dualpipe_kernels._C: one register_apis(m) per subsystem, plus build facts.
#include <dlfcn.h>
#include <execinfo.h>
#include <pybind11/pybind11.h>
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>

#include "shm_bindings.h"
#ifdef DUALPIPE_KERNELS_WITH_CUDA
#include "cuda/api.h"
constexpr bool kWithCuda = true;
#else
constexpr bool kWithCuda = false;
#endif

// Build facts arrive as -D macros from setup.py / CMake (unquoted tokens, so
// they survive the shell); the variadic stringifier keeps commas intact.
#define DPK_STR_(...) #__VA_ARGS__
#define DPK_STR(...) DPK_STR_(__VA_ARGS__)
#ifndef DUALPIPE_KERNELS_VERSION
#define DUALPIPE_KERNELS_VERSION unknown
#endif
#ifndef DUALPIPE_KERNELS_ARCH_LIST
#define DUALPIPE_KERNELS_ARCH_LIST none
#endif
#ifndef DUALPIPE_KERNELS_TORCH_VERSION
#define DUALPIPE_KERNELS_TORCH_VERSION unknown
#endif
#ifndef DUALPIPE_KERNELS_CUDA_VERSION
#define DUALPIPE_KERNELS_CUDA_VERSION none
#endif

namespace py = pybind11;

namespace {

py::dict build_info() {
  py::dict d;
  d["version"] = DPK_STR(DUALPIPE_KERNELS_VERSION);
  d["with_cuda"] = kWithCuda;
  d["cuda_version"] = kWithCuda ? py::str(DPK_STR(DUALPIPE_KERNELS_CUDA_VERSION)) : py::str("");
  d["cuda_arch_list"] = kWithCuda ? py::str(DPK_STR(DUALPIPE_KERNELS_ARCH_LIST)) : py::str("");
  d["torch_version"] = DPK_STR(DUALPIPE_KERNELS_TORCH_VERSION);
  d["compiler"] = __VERSION__;
  d["cplusplus"] = static_cast<long>(__cplusplus);
  py::list subsystems;
  subsystems.append("shm");
  if (kWithCuda) subsystems.append("cuda");
  d["subsystems"] = subsystems;
  return d;
}

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

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "dualpipe-kernels native comm engine (shared-memory channels; CUDA IPC in CUDA builds)";
  m.def("has_cuda", [] { return kWithCuda; }, "True if this build compiled the CUDA sources.");
  m.def("build_info", &build_info, "Facts about this build: version, CUDA, architectures, compiler.");
  m.def("install_native_traceback", &install_native_traceback,
        "Print the native stack on SIGSEGV/SIGBUS/SIGFPE/SIGILL/SIGABRT, then hand the signal to the previous "
        "handler (Python's faulthandler, if enabled); on SIGUSR2 print the receiving thread's stack and go on. "
        "Installed at import when DUALPIPE_KERNELS_NATIVE_TRACEBACK=1.");
  dualpipe::shm::register_apis(m);
#ifdef DUALPIPE_KERNELS_WITH_CUDA
  dualpipe::cuda::register_apis(m);
#endif
}
