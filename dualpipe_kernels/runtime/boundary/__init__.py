"""The boundary wing: everything one stage-boundary message goes through.

- ``codec``: boundary formats (none / packed / bf16 / fp8 / fp8_pow2) and how a
  message's tensors become transfers and back;
- ``header``: the message header (layout, format, flags: host bytes on every wire) and tags;
- ``layout_memory``: what a pipeline remembers between messages (``LayoutMemory``) and
  which channels its messages take (``Channels``: the wire, an in-order channel where
  the transport pairs transfers in posting order, the host channel for headers);
- ``inline`` / ``repeat``: small and repeated messages as one transfer;
- ``pool``: reused receive buffers;
- ``transfer``: one message's send and receive over a Transport;
- ``exchange``: a rank's SEND/RECV actions of a step (post, complete, reap).

Modules here import only each other, without cycles (header <- codec <- inline
<- layout_memory <- repeat <- transfer <- exchange; pool below layout_memory;
tests/unit/test_boundary_imports.py holds it), and the layers below the runtime
(transport, kernels, schedules).
"""
