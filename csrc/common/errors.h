// The error convention of both engines (shm and CUDA IPC), and its helpers.
//
//   std::invalid_argument  the caller passed something wrong   -> ValueError
//   IpcUnavailable         this host/sandbox cannot do what was -> IpcUnavailableError
//                          asked (e.g. CUDA IPC), a fallback      (a RuntimeError)
//                          such as host staging may work
//   std::runtime_error     a transfer, a peer or the engine     -> RuntimeError
//                          failed; the message names rank, peer, tag and size
//   a wait that times out  returns false; the binding raises   -> TimeoutError
//                          (shm) or returns False (CUDA) with the transfer's description
// Every message starts with the rank that reports it when one is known.
#pragma once

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string>

namespace dualpipe {

//! A capability this host lacks (not a bug, not a dead peer): callers may fall back.
class IpcUnavailable : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

//! "<call> of '<what>' failed: <strerror(errno)>", read from errno at the call.
inline std::string errno_message(const std::string& call, const std::string& what) {
  const int e = errno;
  return call + " of '" + what + "' failed: " + std::strerror(e);
}

}  // namespace dualpipe
