"""A worker whose module reads a variable when it is imported (see test_env_delivery)."""

from __future__ import annotations

import os

import phalanx as px

AT_IMPORT = os.environ.get("PX_READ_AT_IMPORT")


class ImportTimeReader(px.Worker):
    def at_import(self):
        return AT_IMPORT
