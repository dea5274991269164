"""Transports: how a packed weight stream reaches the receivers.

Each transport has a sender half (used by ``WeightSender``) and a receiver half that
turns a payload into ``{name: tensor}`` sources plus a release function.
``registry.TRANSPORTS`` is the table of them, by name.
"""
