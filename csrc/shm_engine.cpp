#include "shm_engine.h"

#include <stdexcept>
#include <utility>
#include <vector>

namespace dualpipe::shm {

Engine::Engine(int rank, ChannelConfig cfg) : rank_(rank), cfg_(std::move(cfg)) {
  if (rank < 0) throw std::invalid_argument("rank must be >= 0, got " + std::to_string(rank));
  cfg_.validate();
  sweep_stale_segments();  // what crashed engines (either kind) left behind
}

Engine::~Engine() { close(); }

std::string Engine::create_send_channel(int peer) {
  if (peer == rank_ || peer < 0) throw std::invalid_argument("peer must be another rank >= 0, got " +
                                                             std::to_string(peer));
  std::lock_guard<std::mutex> lk(mu_);
  if (closed_) throw std::runtime_error("engine is closed");
  if (send_.count(peer) != 0) throw std::invalid_argument("send channel to rank " + std::to_string(peer) +
                                                          " already exists");
  auto seg = create_ring_segment(cfg_, rank_, peer);
  std::string name = seg->name();
  send_[peer] = std::make_shared<SendChannel>(std::move(seg), rank_, peer, cfg_);
  return name;
}

void Engine::attach_recv_channel(int peer, const std::string& segment_name) {
  if (peer == rank_ || peer < 0) throw std::invalid_argument("peer must be another rank >= 0, got " +
                                                             std::to_string(peer));
  std::lock_guard<std::mutex> lk(mu_);
  if (closed_) throw std::runtime_error("engine is closed");
  if (recv_.count(peer) != 0) throw std::invalid_argument("recv channel from rank " + std::to_string(peer) +
                                                          " already exists");
  auto seg = std::make_shared<ShmSegment>(ShmSegment::open(segment_name));
  seg->unlink();  // both sides hold a mapping now (or the creator will unlink it on its own)
  auto ch = std::make_shared<RecvChannel>(std::move(seg), rank_, peer, cfg_);
  const RingHeader* h = ch->segment() ? static_cast<const RingHeader*>(ch->segment()->data()) : nullptr;
  if (h == nullptr || h->src_rank != peer || h->dst_rank != rank_) {
    throw std::runtime_error("segment '" + segment_name + "' is the ring " + std::to_string(h ? h->src_rank : -1) +
                             " -> " + std::to_string(h ? h->dst_rank : -1) + ", expected " + std::to_string(peer) +
                             " -> " + std::to_string(rank_));
  }
  recv_[peer] = std::move(ch);
}

void Engine::unlink_send_segment(int peer) { send_channel(peer)->segment()->unlink(); }

std::shared_ptr<SendChannel> Engine::send_channel(int peer) {
  std::lock_guard<std::mutex> lk(mu_);
  if (closed_) throw std::runtime_error("rank " + std::to_string(rank_) + ": the engine is closed");
  auto it = send_.find(peer);
  if (it == send_.end()) throw std::invalid_argument("rank " + std::to_string(rank_) + " has no send channel to rank " +
                                                     std::to_string(peer));
  return it->second;
}

std::shared_ptr<RecvChannel> Engine::recv_channel(int peer) {
  std::lock_guard<std::mutex> lk(mu_);
  if (closed_) throw std::runtime_error("rank " + std::to_string(rank_) + ": the engine is closed");
  auto it = recv_.find(peer);
  if (it == recv_.end()) throw std::invalid_argument("rank " + std::to_string(rank_) +
                                                     " has no recv channel from rank " + std::to_string(peer));
  return it->second;
}

std::shared_ptr<Request> Engine::send(int peer, const void* src, std::uint64_t nbytes, std::int64_t tag,
                                      std::int32_t dtype, std::string what) {
  return send_channel(peer)->post(src, nbytes, tag, dtype, std::move(what));
}

std::shared_ptr<Request> Engine::recv(int peer, void* dst, std::uint64_t nbytes, std::int64_t tag, std::int32_t dtype,
                                      std::string what) {
  return recv_channel(peer)->post(dst, nbytes, tag, dtype, std::move(what));
}

bool Engine::try_send_gather(int peer, const std::vector<SendChannel::Piece>& pieces, std::uint64_t nbytes,
                             std::int64_t tag, std::int32_t dtype) {
  return send_channel(peer)->try_post_gather(pieces, nbytes, tag, dtype);
}

std::shared_ptr<SlotReservation> Engine::reserve(int peer, std::uint64_t nbytes, std::int64_t tag,
                                                 std::int32_t dtype, std::string what, double wait_s,
                                                 std::string* why_not) {
  std::shared_ptr<SendChannel> ch = send_channel(peer);
  std::shared_ptr<SlotReservation> r = ch->reserve(nbytes, tag, dtype, std::move(what), wait_s, why_not);
  if (r) r->keep_alive(std::move(ch));
  return r;
}

SendStats Engine::send_stats(int peer) { return send_channel(peer)->stats(); }

bool Engine::single_copy_to(int peer) { return send_channel(peer)->single_copy_active(); }

bool Engine::has_send_channel(int peer) const {
  std::lock_guard<std::mutex> lk(mu_);
  return send_.count(peer) != 0;
}

bool Engine::has_recv_channel(int peer) const {
  std::lock_guard<std::mutex> lk(mu_);
  return recv_.count(peer) != 0;
}

void Engine::fail_all(const std::string& why) {
  std::vector<std::shared_ptr<Channel>> channels;
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (auto& [peer, ch] : send_) channels.push_back(ch);
    for (auto& [peer, ch] : recv_) channels.push_back(ch);
  }
  for (auto& ch : channels) ch->fail_all(why);
}

void Engine::close() {
  std::map<int, std::shared_ptr<SendChannel>> send;
  std::map<int, std::shared_ptr<RecvChannel>> recv;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (closed_) return;
    closed_ = true;
    send.swap(send_);
    recv.swap(recv_);
  }
  // Channels are closed outside mu_: closing joins worker threads.
  for (auto& [peer, ch] : send) ch->close();
  for (auto& [peer, ch] : recv) ch->close();
  // A peer killed before it mapped our ring, or after creating one we never
  // mapped, leaves a name only its death makes stale: sweep it now rather
  // than at the next engine start.
  sweep_stale_segments();
}

}  // namespace dualpipe::shm
