"""Weights out of the policy: refit into generation engines and Hugging Face export, one protocol in one place.

protocols.py  WeightSource (a back end's rank provides it) and WeightSink (an engine's worker provides it)
sender.py     WeightSender over a WeightSource: the policy ranks' side (shared region, collective send,
              save_pretrained)
receiver.py   WeightReceiver over a WeightSink: the engine workers' side (map the region or receive buckets,
              load them in place)
refit.py      the driver: Senders / Receivers (handles to both ends), SharedMemoryRefitter (colocated) |
              CollectiveRefitter (non-colocated), make_refitter
transfer.py   the wire: TensorSpec, bucket plans, the shared region, the transfer group, flat buffers per dtype
"""
