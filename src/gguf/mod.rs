//! GGUF: memory-mapped reader, writer, metadata values and the tensor index.

mod reader;
mod value;
mod writer;

pub use crate::quant::GgmlType;
pub use reader::{DEFAULT_ALIGNMENT, GGUF_MAGIC, GgufError, GgufFile, MAX_DIMS, TensorInfo};
pub use value::{Value, ValueType};
pub use writer::GgufWriter;
