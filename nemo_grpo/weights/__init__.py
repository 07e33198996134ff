"""Weights out of the policy: refit into generation engines and Hugging Face export, one protocol in one place.

sender.py    WeightSender: the policy workers' side (export buckets, save_pretrained, collective send)
receiver.py  WeightReceiver: the engine workers' side (receive buckets, load them in place)
refit.py     the driver: ObjectStoreRefitter (colocated) | CollectiveRefitter (non-colocated), make_refitter
transfer.py  the wire: TensorSpec, bucket plans, the transfer group, flat buffers per dtype
"""
