"""Autoscaling on queue depth AND GPU utilisation: a pure policy plus thin Ray glue."""
