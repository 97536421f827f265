"""The boundary wing: everything one stage-boundary message goes through.

- ``codec``: boundary formats (none / packed / bf16 / fp8 / fp8_pow2) and how a
  message's tensors become transfers and back;
- ``header``: the message header (layout, format, flags) and tags;
- ``inline`` / ``repeat``: small and repeated messages as one transfer;
- ``pool``: reused receive buffers;
- ``transfer``: one message's send and receive over a Transport;
- ``exchange``: a rank's SEND/RECV actions of a step (post, complete, reap).

Modules here import only each other (downwards in the list above reads
upwards: ``exchange`` uses ``transfer``, which uses the rest) and the layers
below the runtime (transport, kernels, schedules).
"""
