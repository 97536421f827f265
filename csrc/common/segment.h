// POSIX shared-memory segments of both engines: create / open / map / unlink, RAII.
//
// No torch, no pybind11. Every segment either engine creates is named
// "/dpk-<creator pid>-<random>-<label>" (shm rings: label "ring-<src>to<dst>";
// CUDA IPC control blocks: "cuda-<src>to<dst>"), so that stale segments
// (creator dead) are recognised and removed by one sweep, and so that a test
// can check that none of ours is left in /dev/shm.
//
// The shared-memory rings of the CPU engine are anonymous instead
// (create_anonymous: a memfd, opened by the peer through /proc/<pid>/fd/<fd>),
// so they have no name in /dev/shm at all and nothing is left behind even when
// every process is killed before its peer has mapped the ring.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <string>

namespace dualpipe {

//! Prefix of every segment name we create (without the leading '/').
inline constexpr const char* kSegmentPrefix = "dpk-";
//! Prefix older CUDA engine builds used ("/dpk_cuda_<pid>_..."): swept too.
inline constexpr const char* kLegacyCudaPrefix = "dpk_cuda_";

//! A mapped POSIX shared-memory segment. Owns the mapping; unlinks the name on
//! destruction only if it is the creator and has not unlinked it yet.
class ShmSegment {
 public:
  //! Create a new segment of `bytes` bytes (zero-filled), named from `label`.
  //! The pages are reserved now (posix_fallocate), so a full /dev/shm is an
  //! error here rather than a SIGBUS later. Throws std::runtime_error naming
  //! the segment on failure.
  static ShmSegment create(const std::string& label, std::size_t bytes);
  //! Create an anonymous segment (memfd_create) of `bytes` bytes: no /dev/shm
  //! name. name() is "/proc/<pid>/fd/<fd>", which open() maps while this
  //! segment has not been unlink()ed (unlink closes the creator's descriptor;
  //! the mappings stay valid). Opening it needs read access to this process's
  //! /proc entry (same user; a /proc mounted with hidepid may refuse: set
  //! DUALPIPE_KERNELS_SHM_NAMED=1 for named segments then).
  static ShmSegment create_anonymous(const std::string& label, std::size_t bytes);
  //! Open and map an existing segment by its full name (as returned by name()).
  static ShmSegment open(const std::string& name);

  ShmSegment() = default;
  ShmSegment(ShmSegment&& other) noexcept;
  ShmSegment& operator=(ShmSegment&& other) noexcept;
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;
  ~ShmSegment();

  //! Remove the name from /dev/shm (the mapping stays valid). Idempotent; a
  //! name already removed by the peer is not an error.
  void unlink();

  void* data() const { return data_; }
  std::size_t size() const { return size_; }
  const std::string& name() const { return name_; }
  bool unlinked() const { return unlinked_; }

 private:
  void release() noexcept;

  std::string name_;
  void* data_ = nullptr;
  std::size_t size_ = 0;
  bool creator_ = false;
  bool unlinked_ = false;
  int fd_ = -1;  // an anonymous segment's descriptor, kept by its creator until unlink()
};

//! True unless DUALPIPE_KERNELS_SHM_NAMED=1 asks for named /dev/shm segments.
bool anonymous_segments_enabled();

//! Remove /dev/shm segments of ours (either engine, any build) whose creator
//! process no longer exists or is a zombie. Returns the number removed. Safe
//! to call concurrently from many processes. Both engines call it at start and
//! at close, so a peer killed at any moment leaves nothing once a survivor closes.
int sweep_stale_segments();

//! Names (without '/') of our segments currently present in /dev/shm.
std::string list_segments();

//! The creator pid encoded in one of our segment names (with or without the
//! leading '/'), or -1 if the name is not one of ours.
int segment_creator_pid(const std::string& name);

}  // namespace dualpipe
