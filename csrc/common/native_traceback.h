// Native stacks for crashes and hangs (DUALPIPE_KERNELS_NATIVE_TRACEBACK=1 installs it at import):
// Python's faulthandler shows only Python frames.
#pragma once

namespace dualpipe {

//! On SIGSEGV/SIGBUS/SIGFPE/SIGILL/SIGABRT: write the faulting address, the
//! native stack (object(+offset), which addr2line resolves) and where this
//! library is loaded, then hand the signal to the previous handler. On
//! SIGUSR2: write the receiving thread's stack and go on. False if a handler
//! could not be installed.
bool install_native_traceback();

}  // namespace dualpipe
