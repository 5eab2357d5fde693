//! YAML for `pinswap mutate`: documents read with the byte span of every
//! node (`doc`), edits of the original text at those spans (`edit`), and
//! a writer for YAML pinswap makes itself (`emit`).

pub mod doc;
pub(crate) mod edit;
pub(crate) mod emit;

pub use emit::to_yaml;

/// Why YAML text could not be read or edited.
#[derive(Debug, thiserror::Error)]
pub enum YamlError {
    /// The text is not YAML.
    #[error("document {document}: line {line} column {column}: {reason}")]
    Syntax {
        /// 1-based document number in the stream.
        document: usize,
        /// 1-based line.
        line: usize,
        /// 1-based column (bytes).
        column: usize,
        /// The parser's message.
        reason: String,
    },
    /// Aliases that would expand the text into far more nodes than it
    /// writes out (an "alias bomb"): refused before the memory is spent.
    #[error(
        "document {document}: line {line} column {column}: aliases expand to more than {limit} nodes beyond those written out; refused (write the repeated values out, or use fewer aliases)"
    )]
    Aliases {
        /// 1-based document number in the stream.
        document: usize,
        /// 1-based line of the alias that crossed the bound.
        line: usize,
        /// 1-based column (bytes).
        column: usize,
        /// [`doc::ALIAS_NODES`].
        limit: usize,
    },
    /// YAML that this editor leaves alone rather than risk changing more
    /// than the value.
    #[error("line {line} column {column}: {reason}")]
    Unsupported {
        /// 1-based line.
        line: usize,
        /// 1-based column (bytes).
        column: usize,
        /// What is not supported.
        reason: String,
    },
}
