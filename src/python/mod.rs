//! Python bindings (feature `python`).
