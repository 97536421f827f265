// CUDA IPC comm engine, host logic: teardown. Each side first closes what it
// mapped of its peers and says so, then frees what it exported once the peer
// detached, died or never attached; see the teardown note in ipc_engine.h.
#include <algorithm>
#include <iterator>

#include "common/liveness.h"
#include "common/poll.h"
#include "cuda/ipc_engine.h"

namespace dualpipe::cuda {

using Clock = std::chrono::steady_clock;

// ---------------------------------------------------------------------------
// Teardown
// ---------------------------------------------------------------------------

void Engine::release_imports(Channel& ch, bool streams_idle) {
  // Peer resources mapped into this process. With copies possibly still in
  // flight (streams not idle) the mappings are leaked rather than pulled away,
  // and the peer is told so (kAbandoned): it must then leak what it exported.
  if (streams_idle) {
    close_mappings(ch);
    if (ch.slots_ipc_opened) api_->ipc_close_mem_handle(ch.slots);
    ch.slots_ipc_opened = false;
    if (ch.host_registered) api_->host_unregister(ch.slots);
    ch.host_registered = false;
  }
  if (ch.ctl != nullptr) {
    (ch.outgoing ? ch.ctl->sender_detached : ch.ctl->receiver_detached)
        .store(streams_idle ? kDetached : kAbandoned, std::memory_order_release);
  }
}

void Engine::release_exports(Channel& ch, Clock::time_point deadline, bool streams_idle) {
  // Memory and events the peer may have opened: CUDA leaves it undefined to
  // free them while the peer still uses them, so wait (bounded) until the peer
  // has detached, has exited (a zombie counts), or never attached; past the
  // deadline with the peer still attached they are leaked, not freed.
  bool safe = true;
  if (ch.ctl != nullptr) {
    CtlBlock& c = *ch.ctl;
    const bool peer_attached = ch.outgoing || c.sender_attached.load(std::memory_order_acquire) != 0;
    const int peer_pid = ch.outgoing ? c.receiver_pid : c.sender_pid.load();
    const auto& peer_detached = ch.outgoing ? c.receiver_detached : c.sender_detached;
    const auto poll_start = Clock::now();
    while (peer_attached) {
      const std::uint32_t state = peer_detached.load(std::memory_order_acquire);
      if (state == kDetached || (peer_pid > 0 && !process_dead_reason(peer_pid).empty())) break;
      if (state == kAbandoned || Clock::now() >= deadline) {
        safe = false;
        break;
      }
      backoff(Clock::now() - poll_start);
    }
  }
  release_keepalives(ch, safe);
  const bool exported = ch.slots_device_owned;
  for (const auto& [n, ev] : ch.pending) {
    if (streams_idle) pool_->give(ev);  // else leaked: a record may still be pending
  }
  ch.pending.clear();
  if (streams_idle && safe) {
    if (ch.slots_device_owned) api_->free(ch.slots);
    ch.slots_device_owned = false;
  } else if (exported) {
    bump(&EngineStats::exports_leaked);
  }
  if (ch.host_registered && streams_idle) api_->host_unregister(ch.slots);
  ch.host_registered = false;
  ch.ctl = nullptr;
  // A host ring that copies may still read stays mapped (its name went at attach).
  if (!streams_idle && ch.staging == Staging::kHost) abandoned_.push_back(std::move(ch.segment));
  ch.segment = ShmSegment();  // unmaps; unlinks the name if still ours
}

bool Engine::drain_streams(Clock::time_point deadline) {
  const auto poll_start = Clock::now();
  for (Stream s : {send_stream_, recv_stream_, done_stream_}) {
    while (s != nullptr) {
      const Status r = api_->stream_query(s);
      if (r == kOk) break;
      if (r != kNotReady || Clock::now() >= deadline) {
        if (r != kNotReady) (void)api_->error_text(r);
        return false;
      }
      backoff(Clock::now() - poll_start);
    }
  }
  return true;
}

void Engine::close(double timeout_s) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (closed_) return;
    closed_ = true;
    stop_ = true;
  }
  cv_.notify_all();
  if (worker_.joinable()) worker_.join();
  // The worker is gone: every channel is this thread's now. Taken out of the
  // maps (channel_status then says there is none) and torn down without the lock.
  std::vector<std::unique_ptr<Channel>> channels;
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (auto* map : {&outgoing_, &incoming_}) {
      for (auto& kv : *map) channels.push_back(std::move(kv.second));
      map->clear();
    }
  }
  active_.clear();
  const std::string why = "rank " + std::to_string(rank_) + ": transport closed before the transfer completed";
  for (auto& ch : channels) {
    for (auto& op : ch->inbox) ch->queue.push_back(std::move(op));
    ch->inbox.clear();
    fail_channel(*ch, why);
  }
  released_.clear();

  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(timeout_s < 0 ? 0.0 : timeout_s));
  int previous = -1;
  const bool have_device = api_->get_device(&previous) == kOk && api_->set_device(device_) == kOk;
  // A peer that died with a signal write enqueued but not run: release the
  // streams waiting for it before draining them.
  for (auto& ch : channels) {
    if (!have_device || !ch->wait_any || ch->signals == nullptr || !ch->dead.empty()) continue;
    if (peer_dead_reason(ch->peer_pid).empty()) continue;
    const Status r = api_->set_value(ch->outgoing ? ch->freed_signal() : ch->ready_signal(), ch->wait_target);
    if (r != kOk) (void)api_->error_text(r);
  }
  // Let copies already on the comm streams finish (bounded) before unmapping
  // what they read or write.
  const bool idle = have_device && drain_streams(deadline);
  for (auto& ch : channels) ch->unsettled.clear();
  // Imports first on every channel (this tells each peer it may free its
  // exports), then exports, so two ranks closing together never wait on each other.
  for (auto& ch : channels) release_imports(*ch, idle);
  for (auto& ch : channels) release_exports(*ch, deadline, idle);
  channels.clear();
  released_.clear();  // export keep-alives the peers no longer map
  if (idle) {
    for (Stream* s : {&send_stream_, &recv_stream_, &done_stream_}) {
      if (owns_streams_ && *s != nullptr) api_->stream_destroy(*s);
      *s = nullptr;
    }
  }
  if (have_device && previous >= 0) api_->set_device(previous);
  sweep_stale_segments();  // names a dead peer created and nobody mapped
}

}  // namespace dualpipe::cuda
