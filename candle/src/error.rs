//! The crate's one error type: what went wrong, naming the parameter, rank or call.

/// What can go wrong when training a candle model with `overlap`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A parameter's name matches no layer rule ([`crate::Rules`]).
    #[error("parameter `{name}` matches no layer rule: {rules}; place it with Rules::layer(\"{name}\", LAYER) or change the rules")]
    NoRule {
        /// The parameter's name.
        name: String,
        /// The rules tried, in words.
        rules: String,
    },
    /// A parameter the session cannot take as it is (its dtype or device), or a
    /// gradient that does not fit it.
    #[error("parameter `{name}`: {reason}")]
    Param {
        /// The parameter's name.
        name: String,
        /// What is wrong and what to do.
        reason: String,
    },
    /// A call out of order, or arguments that do not match the job (ranks, segments,
    /// micro-batches).
    #[error("{0}")]
    Usage(String),
    /// The config (mesh, buckets, groups, schedule, clipping, `[forward]`).
    #[error(transparent)]
    Config(#[from] overlap::ConfigError),
    /// The session: planning, validation, the backend, a step.
    #[error(transparent)]
    Session(#[from] overlap::Error),
    /// candle, in the trainer's forward or backward or in reading a tensor.
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
}
