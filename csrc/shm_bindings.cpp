// Python registration of the CPU shared-memory engine: dualpipe_kernels._C.shm.
//
// Pointers cross as integers (tensor.data_ptr()); the Python wrapper
// (dualpipe_kernels/transport/native.py) checks devices, contiguity and
// lifetimes. Every blocking call releases the GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <tuple>

#include "common/errors.h"
#include "common/liveness.h"
#include "shm_bindings.h"
#include "shm_engine.h"

namespace py = pybind11;

namespace dualpipe::shm {
namespace {

//! Raise the Python exception for a finished-with-error or timed-out wait.
[[noreturn]] void raise(PyObject* type, const std::string& msg) {
  PyErr_SetString(type, msg.c_str());
  throw py::error_already_set();
}

void wait_or_raise(const Request& r, double timeout_s) {
  // Wait in slices so that Ctrl-C (a pending Python signal) interrupts a long wait.
  constexpr double kSliceS = 0.1;
  const auto start = std::chrono::steady_clock::now();
  bool finished = false;
  while (!finished) {
    double slice = kSliceS;
    if (timeout_s >= 0) {
      const double left = timeout_s - std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (left <= 0) break;
      slice = std::min(slice, left);
    }
    {
      py::gil_scoped_release nogil;
      finished = r.wait(slice);
    }
    if (!finished && PyErr_CheckSignals() != 0) throw py::error_already_set();
  }
  if (!finished) raise(PyExc_TimeoutError, r.timeout_message(timeout_s));
  if (r.state() == Request::State::kFailed) raise(PyExc_RuntimeError, r.error());
}

std::unique_ptr<Engine> make_engine(int rank, std::uint32_t num_slots, std::uint64_t slot_bytes, double spin_us,
                                    double liveness_interval_s, std::uint64_t inline_max_bytes,
                                    std::vector<std::string> dtype_names, bool single_copy,
                                    std::uint64_t single_copy_min_bytes, double recv_poll_ms) {
  ChannelConfig c;
  c.num_slots = num_slots;
  c.slot_bytes = slot_bytes;
  c.spin_us = spin_us;
  c.liveness_interval_s = liveness_interval_s;
  c.inline_max_bytes = inline_max_bytes;
  c.dtype_names = std::move(dtype_names);
  c.single_copy = single_copy;
  c.single_copy_min_bytes = single_copy_min_bytes;
  c.recv_poll_ms = recv_poll_ms;
  return std::make_unique<Engine>(rank, std::move(c));  // std::invalid_argument -> ValueError
}

//! Engine::reserve for Python: the reservation, or None when wait_s passed (TimeoutError instead if asked).
std::shared_ptr<SlotReservation> reserve(Engine& e, int peer, std::uint64_t nbytes, std::int64_t tag,
                                         std::int32_t dtype, std::string what, double wait_s, bool raise_on_timeout) {
  std::string why;
  std::shared_ptr<SlotReservation> r;
  {
    py::gil_scoped_release nogil;
    r = e.reserve(peer, nbytes, tag, dtype, std::move(what), wait_s, &why);
  }
  if (!r && raise_on_timeout) raise(PyExc_TimeoutError, why);
  return r;
}

void register_reservation(py::module_& m) {
  py::class_<SlotReservation, std::shared_ptr<SlotReservation>>(
      m, "SlotReservation", py::buffer_protocol(),
      "A ring slot reserved for one message: write it through the buffer protocol "
      "(torch.frombuffer(r, dtype=torch.uint8)), then commit() or abort(). Drop every view before committing.")
      .def_buffer([](SlotReservation& r) {
        if (!r.open()) throw std::runtime_error(describe(r.info()) + ": the reservation is no longer open");
        return py::buffer_info(r.data(), 1, py::format_descriptor<std::uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(r.nbytes())}, {static_cast<py::ssize_t>(1)}, false);
      })
      .def("commit", &SlotReservation::commit, "Publish the slot as one message (RuntimeError if the channel broke).")
      .def("abort", &SlotReservation::abort, "Give the slot back unpublished (idempotent).")
      .def_property_readonly("nbytes", &SlotReservation::nbytes)
      .def_property_readonly("open", &SlotReservation::open)
      .def("describe", [](const SlotReservation& r) { return describe(r.info()); });
}

}  // namespace

void register_apis(py::module_& parent) {
  // Shared by both engines (common/errors.h): a capability this host lacks.
  py::register_exception<IpcUnavailable>(parent, "IpcUnavailableError", PyExc_RuntimeError);
  parent.def("process_dead_reason", &process_dead_reason, py::arg("pid"),
             "'' if process pid is alive, else why not ('exited', 'exited (zombie)').");
  py::module_ m = parent.def_submodule("shm", "CPU shared-memory channels between processes on one host");
  const ChannelConfig defaults;
  register_reservation(m);

  py::class_<Request, std::shared_ptr<Request>>(m, "Request", "A posted send or receive (an event).")
      .def("wait", &wait_or_raise, py::arg("timeout_s") = -1.0,
           "Block until done. TimeoutError after timeout_s seconds (< 0: forever); RuntimeError if it failed.")
      .def("query", &Request::query, "True once finished (done or failed); never blocks.")
      .def("failed", [](const Request& r) { return r.state() == Request::State::kFailed; })
      .def("error", &Request::error)
      .def("bytes_done", &Request::bytes_done)
      .def("describe", [](const Request& r) { return describe(r.info()); });

  py::class_<Engine>(m, "Engine", "Shared-memory channels of one rank to its same-host peers.")
      .def(py::init(&make_engine), py::arg("rank"), py::arg("num_slots") = defaults.num_slots,
           py::arg("slot_bytes") = defaults.slot_bytes, py::arg("spin_us") = defaults.spin_us,
           py::arg("liveness_interval_s") = defaults.liveness_interval_s,
           py::arg("inline_max_bytes") = defaults.inline_max_bytes,
           py::arg("dtype_names") = std::vector<std::string>{}, py::arg("single_copy") = defaults.single_copy,
           py::arg("single_copy_min_bytes") = defaults.single_copy_min_bytes,
           py::arg("recv_poll_ms") = defaults.recv_poll_ms)
      .def("create_send_channel", &Engine::create_send_channel, py::arg("peer"))
      .def("attach_recv_channel", &Engine::attach_recv_channel, py::arg("peer"), py::arg("segment_name"))
      .def("unlink_send_segment", &Engine::unlink_send_segment, py::arg("peer"))
      .def(
          "send",
          [](Engine& e, int peer, std::uintptr_t ptr, std::uint64_t nbytes, std::int64_t tag, std::int32_t dtype,
             std::string what) { return e.send(peer, reinterpret_cast<const void*>(ptr), nbytes, tag, dtype, what); },
          py::arg("peer"), py::arg("ptr"), py::arg("nbytes"), py::arg("tag"), py::arg("dtype") = 0,
          py::arg("what") = "", "Post a send of nbytes at address ptr; returns a Request at once.")
      .def(
          "try_send_gather",
          [](Engine& e, int peer, const std::vector<std::tuple<std::uint64_t, std::uintptr_t, std::uint64_t>>& pieces,
             std::uint64_t nbytes, std::int64_t tag, std::int32_t dtype) {
            std::vector<SendChannel::Piece> ps;
            ps.reserve(pieces.size());
            for (const auto& [offset, ptr, n] : pieces) ps.push_back({offset, reinterpret_cast<const void*>(ptr), n});
            return e.try_send_gather(peer, ps, nbytes, tag, dtype);
          },
          py::arg("peer"), py::arg("pieces"), py::arg("nbytes"), py::arg("tag"), py::arg("dtype") = 0,
          "Write a small message of nbytes from (offset, ptr, nbytes) pieces straight into the ring; True if "
          "sent (complete), False if it must be posted with send() instead.")
      .def(
          "recv",
          [](Engine& e, int peer, std::uintptr_t ptr, std::uint64_t nbytes, std::int64_t tag, std::int32_t dtype,
             std::string what) { return e.recv(peer, reinterpret_cast<void*>(ptr), nbytes, tag, dtype, what); },
          py::arg("peer"), py::arg("ptr"), py::arg("nbytes"), py::arg("tag"), py::arg("dtype") = 0,
          py::arg("what") = "", "Post a receive of exactly nbytes into address ptr; returns a Request at once.")
      .def("reserve", &reserve, py::arg("peer"), py::arg("nbytes"), py::arg("tag"), py::arg("dtype") = 0,
           py::arg("what") = "", py::arg("wait_s") = 0.0, py::arg("raise_on_timeout") = false,
           "Reserve the next ring slot to peer for one message of nbytes (<= slot_bytes): a SlotReservation, "
           "or None if none was free within wait_s (TimeoutError naming the transfer if raise_on_timeout).")
      .def(
          "send_stats",
          [](Engine& e, int peer) {
            const SendStats s = e.send_stats(peer);
            py::dict d;
            d["copied_bytes"] = s.copied_bytes;
            d["copied_messages"] = s.copied_messages;
            d["reserved_bytes"] = s.reserved_bytes;
            d["reserved_messages"] = s.reserved_messages;
            return d;
          },
          py::arg("peer"), "Counters of the ring to peer: bytes the engine copied in vs bytes committed in place.")
      .def("single_copy_to", &Engine::single_copy_to, py::arg("peer"),
           "True if sends of >= single_copy_min_bytes to peer are read by the peer straight from our memory.")
      .def("has_send_channel", &Engine::has_send_channel)
      .def("has_recv_channel", &Engine::has_recv_channel)
      .def("fail_all", &Engine::fail_all, py::arg("message"), py::call_guard<py::gil_scoped_release>(),
           "Fail every unfinished and later send and receive with `message` (wakes blocked waits).")
      .def("close", &Engine::close, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("rank", &Engine::rank)
      .def_property_readonly("num_slots", [](const Engine& e) { return e.config().num_slots; })
      .def_property_readonly("slot_bytes", [](const Engine& e) { return e.config().slot_bytes; })
      .def_property_readonly("single_copy_min_bytes",
                             [](const Engine& e) { return e.config().single_copy_min_bytes; });

  m.def("sweep_stale_segments", &sweep_stale_segments,
        "Unlink /dev/shm segments of ours (either engine) whose creator process is gone; returns how many.");
  m.def(
      "list_segments",
      [] {
        std::vector<std::string> out;
        std::string all = list_segments();
        std::size_t start = 0;
        while (start < all.size()) {
          std::size_t end = all.find('\n', start);
          if (end == std::string::npos) end = all.size();
          out.push_back(all.substr(start, end - start));
          start = end + 1;
        }
        return out;
      },
      "Names of our segments currently in /dev/shm.");
  m.attr("SEGMENT_PREFIX") = kSegmentPrefix;
}

}  // namespace dualpipe::shm
