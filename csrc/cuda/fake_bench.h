// Host cost of the CUDA IPC engine, measured without a GPU: both ends of a
// channel in one process over the fake device (fake_device.h), whose copies
// move no bytes while timed (a copy is device time, not host time). What is
// left is what the engine costs the host per message: posting, the worker's
// matching and enqueueing, and completion.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cuda/ipc_engine.h"

namespace dualpipe::cuda {

struct FakeBenchRow {
  std::uint64_t size_bytes = 0;
  int messages = 0;               //!< per burst
  int bursts = 0;                 //!< timed bursts (median taken)
  double host_us_per_msg = 0;     //!< post + completion, per message (median burst)
  double post_us_per_msg = 0;     //!< posting both sides, per message
  double complete_us_per_msg = 0;  //!< from the last post to every op done, per message
  bool zero_copy = false;         //!< the sends went zero-copy
  bool verified = false;          //!< a burst with bytes moved arrived byte-exact
};

//! One row per size: `bursts` timed bursts of `messages` messages rank 0 -> rank 1
//! (receives posted first, then sends, then every op waited for), after one
//! verified burst. Throws std::runtime_error if a transfer fails or arrives wrong.
std::vector<FakeBenchRow> fake_host_cost(const std::vector<std::uint64_t>& sizes, int messages, int bursts,
                                         const EngineOptions& options);

}  // namespace dualpipe::cuda
