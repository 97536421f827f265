// The CPU comm engine of one process: its shared-memory channels to every
// same-host peer, keyed by peer rank.
//
// Rendezvous is the caller's job (the Python transport uses the process
// group's store): for each peer, create_send_channel() makes our outgoing ring
// and returns its segment name; the peer calls attach_recv_channel() with that
// name, which maps the segment and unlinks its name right away (so nothing is
// left in /dev/shm even if a process is killed later); the creator calls
// unlink_send_segment() once the peer confirmed (a no-op if the name is gone).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "shm_channel.h"

namespace dualpipe::shm {

class Engine {
 public:
  Engine(int rank, ChannelConfig cfg);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  //! Create the ring rank -> peer; returns the segment name to hand to the peer.
  std::string create_send_channel(int peer);
  //! Map the ring peer -> rank created by the peer, then unlink its name.
  void attach_recv_channel(int peer, const std::string& segment_name);
  //! Unlink the name of our ring to `peer` (after the peer mapped it).
  void unlink_send_segment(int peer);

  std::shared_ptr<Request> send(int peer, const void* src, std::uint64_t nbytes, std::int64_t tag, std::int32_t dtype,
                                std::string what = "");
  std::shared_ptr<Request> recv(int peer, void* dst, std::uint64_t nbytes, std::int64_t tag, std::int32_t dtype,
                                std::string what = "");
  //! SendChannel::try_post_gather() on the ring to `peer`.
  bool try_send_gather(int peer, const std::vector<SendChannel::Piece>& pieces, std::uint64_t nbytes, std::int64_t tag,
                       std::int32_t dtype);

  //! SendChannel::reserve() on the ring to `peer`; the reservation keeps the channel alive.
  std::shared_ptr<SlotReservation> reserve(int peer, std::uint64_t nbytes, std::int64_t tag, std::int32_t dtype,
                                           std::string what, double wait_s, std::string* why_not = nullptr);
  //! Counters of the ring to `peer` (see SendStats).
  SendStats send_stats(int peer);

  //! Whether large sends to `peer` go single-copy (process_vm_readv; see shm_ring.h).
  bool single_copy_to(int peer);

  bool has_send_channel(int peer) const;
  bool has_recv_channel(int peer) const;
  //! Channel::fail_all(why) on every channel: every unfinished and later send or receive fails with
  //! `why` (a peer failed: nothing more will move). The channels stay mapped until close().
  void fail_all(const std::string& why);
  //! Close every channel (fails unfinished requests) and unmap. Idempotent.
  void close();

  int rank() const { return rank_; }
  const ChannelConfig& config() const { return cfg_; }

 private:
  std::shared_ptr<SendChannel> send_channel(int peer);
  std::shared_ptr<RecvChannel> recv_channel(int peer);

  const int rank_;
  const ChannelConfig cfg_;
  mutable std::mutex mu_;  // guards the maps (channels themselves are thread-safe)
  std::map<int, std::shared_ptr<SendChannel>> send_;
  std::map<int, std::shared_ptr<RecvChannel>> recv_;
  bool closed_ = false;
};

}  // namespace dualpipe::shm
