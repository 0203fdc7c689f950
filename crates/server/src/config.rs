//! How a `KvService` is set up: the device, the model (a [`ServedModel`], validated once,
//! when it is made), the budget, the prefix cache, the server's own limits and the idle
//! expiry of sequences.

use std::sync::Arc;
use std::time::Duration;

use kvvm::layout::{KvDtype, KvError, KvGeometry, KvLayout};
use kvvm::{DeviceId, VirtualMemoryBackend};

use crate::limits::Limits;

/// How a `KvService` is set up.
#[derive(Clone)]
pub struct ServiceConfig {
    /// The driver backend (see [`kvvm::open_backend`]).
    pub backend: Arc<dyn VirtualMemoryBackend>,
    /// The device whose memory is served.
    pub device: DeviceId,
    /// The memory budget in bytes; `None`: the device's free memory when the service starts
    /// (unlimited if the driver cannot say).
    pub budget_bytes: Option<u64>,
    /// The model served: its preset's name and its KV geometry (element type and context
    /// limit: the largest `max_tokens` a sequence may ask for).
    pub model: ServedModel,
    /// The physical KV layout.
    pub layout: KvLayout,
    /// Most bytes of released handles kept for reuse (`None`: the manager's default).
    pub pool_cap_bytes: Option<u64>,
    /// Whether prompts sent with `token_ids` go through the prefix cache (shared prefixes
    /// found automatically and mapped read-only).
    pub prefix_cache: bool,
    /// With API keys: one prefix cache for every key (a key's prompts can hit another's
    /// prefixes) instead of one per key.
    pub shared_prefix_cache: bool,
    /// The server's limits on live sequences, reserved address space and committed bytes.
    pub limits: Limits,
    /// Sequences nobody read, grew or released for this long are released (`None`: never).
    pub idle_timeout: Option<Duration>,
}

impl std::fmt::Debug for ServiceConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServiceConfig")
            .field("backend", &self.backend.name())
            .field("device", &self.device)
            .field("budget_bytes", &self.budget_bytes)
            .field("model", &self.model)
            .field("layout", &self.layout)
            .field("pool_cap_bytes", &self.pool_cap_bytes)
            .field("prefix_cache", &self.prefix_cache)
            .field("shared_prefix_cache", &self.shared_prefix_cache)
            .field("limits", &self.limits)
            .field("idle_timeout", &self.idle_timeout)
            .finish()
    }
}

/// The default idle timeout of a sequence: 10 minutes.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(600);

impl ServiceConfig {
    /// Defaults for serving `model` on `backend`: device 0, seq-major, the device's free
    /// memory as the budget, the prefix cache on (one per key), the default [`Limits`], idle
    /// sequences released after [`DEFAULT_IDLE_TIMEOUT`].
    pub fn new(backend: Arc<dyn VirtualMemoryBackend>, model: ServedModel) -> Self {
        ServiceConfig {
            backend,
            device: DeviceId(0),
            budget_bytes: None,
            model,
            layout: KvLayout::SeqMajor,
            pool_cap_bytes: None,
            prefix_cache: true,
            shared_prefix_cache: false,
            limits: Limits::default(),
            idle_timeout: Some(DEFAULT_IDLE_TIMEOUT),
        }
    }
}

/// The model a service serves: a preset's name, its KV element type and its geometry at the
/// context limit. Made only by [`ServedModel::preset`], which validates all three: a service
/// is never configured with an unknown model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServedModel {
    name: String,
    dtype: KvDtype,
    geometry: KvGeometry,
}

impl ServedModel {
    /// The preset `name` (see [`KvGeometry::preset`]) in `dtype`, with a context limit of
    /// `max_tokens`. An unknown name or a limit out of range is an error.
    pub fn preset(name: &str, dtype: KvDtype, max_tokens: u64) -> Result<Self, KvError> {
        Ok(ServedModel {
            name: name.to_owned(),
            dtype,
            geometry: KvGeometry::preset(name, dtype, max_tokens)?,
        })
    }

    /// The same model with a context limit of `max_tokens`.
    pub fn with_max_tokens(&self, max_tokens: u64) -> Result<Self, KvError> {
        Ok(ServedModel {
            geometry: self.geometry.with_max_tokens(max_tokens)?,
            ..self.clone()
        })
    }

    /// The preset's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The KV element type.
    pub fn dtype(&self) -> KvDtype {
        self.dtype
    }

    /// The KV geometry at the context limit.
    pub fn geometry(&self) -> &KvGeometry {
        &self.geometry
    }
}
