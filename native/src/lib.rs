//! Switchyard's native router core.
//!
//! * [`index`]: the prefix index (the projection of the `kv` and `workers` streams), with the
//!   exact rules of the Python reference in `control_plane/index/prefix_index.py`;
//! * [`envelope`]: KV events decoded straight from the envelope's MessagePack bytes;
//! * [`mp`]: the MessagePack reader/writer both use;
//! * [`decide`]: the kv cost of a routing candidate, term for term as `control_plane/router/decision.py`;
//! * [`blockhash`]: vLLM's sha256 block hash, for the simulated engine's trace replay.
//!
//! The pure core has no Python in it (`cargo test` tests it as is); the `python` feature adds
//! the PyO3 bindings maturin builds into the `switchyard_native` extension module.

pub mod bitset;
pub mod blockhash;
pub mod decide;
pub mod envelope;
pub mod holders;
pub mod index;
pub mod mp;

#[cfg(feature = "python")]
mod py;
