//! Element types: DLPack codes, numpy names and Rust `Pod` types.

use std::fmt;

use static_assertions::{assert_eq_size, const_assert};

use dlpark::ffi::DLDataTypeCode;

const DL_INT: u8 = DLDataTypeCode::INT.0;
const DL_UINT: u8 = DLDataTypeCode::UINT.0;
const DL_FLOAT: u8 = DLDataTypeCode::FLOAT.0;
const DL_BFLOAT: u8 = DLDataTypeCode::BFLOAT.0;
const DL_COMPLEX: u8 = DLDataTypeCode::COMPLEX.0;
const DL_BOOL: u8 = DLDataTypeCode::BOOL.0;

/// The element types pinstage moves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DType {
    /// `bool`, one byte (0 or 1).
    Bool,
    /// `int8`.
    I8,
    /// `int16`.
    I16,
    /// `int32`.
    I32,
    /// `int64`.
    I64,
    /// `uint8`.
    U8,
    /// `uint16`.
    U16,
    /// `uint32`.
    U32,
    /// `uint64`.
    U64,
    /// IEEE half precision.
    F16,
    /// bfloat16.
    BF16,
    /// `float32`.
    F32,
    /// `float64`.
    F64,
    /// Two `float32`.
    C64,
    /// Two `float64`.
    C128,
}

impl DType {
    /// Every dtype, in a stable order.
    pub const ALL: [DType; 15] = [
        DType::Bool,
        DType::I8,
        DType::I16,
        DType::I32,
        DType::I64,
        DType::U8,
        DType::U16,
        DType::U32,
        DType::U64,
        DType::F16,
        DType::BF16,
        DType::F32,
        DType::F64,
        DType::C64,
        DType::C128,
    ];

    /// Size of one element in bytes.
    pub const fn itemsize(self) -> usize {
        match self {
            DType::Bool | DType::I8 | DType::U8 => 1,
            DType::I16 | DType::U16 | DType::F16 | DType::BF16 => 2,
            DType::I32 | DType::U32 | DType::F32 => 4,
            DType::I64 | DType::U64 | DType::F64 | DType::C64 => 8,
            DType::C128 => 16,
        }
    }

    /// DLPack `(code, bits)`, lanes being 1.
    pub const fn dlpack(self) -> (u8, u8) {
        let bits = (self.itemsize() * 8) as u8;
        let code = match self {
            DType::Bool => DL_BOOL,
            DType::I8 | DType::I16 | DType::I32 | DType::I64 => DL_INT,
            DType::U8 | DType::U16 | DType::U32 | DType::U64 => DL_UINT,
            DType::F16 | DType::F32 | DType::F64 => DL_FLOAT,
            DType::BF16 => DL_BFLOAT,
            DType::C64 | DType::C128 => DL_COMPLEX,
        };
        (code, bits)
    }

    /// The dtype of a DLPack `(code, bits, lanes)`, or `None` when unsupported.
    pub fn from_dlpack(code: u8, bits: u8, lanes: u16) -> Option<DType> {
        if lanes != 1 {
            return None;
        }
        DType::ALL.into_iter().find(|d| d.dlpack() == (code, bits))
    }

    /// The numpy name (`"int32"`, `"bfloat16"`, `"complex64"`...).
    pub const fn name(self) -> &'static str {
        match self {
            DType::Bool => "bool",
            DType::I8 => "int8",
            DType::I16 => "int16",
            DType::I32 => "int32",
            DType::I64 => "int64",
            DType::U8 => "uint8",
            DType::U16 => "uint16",
            DType::U32 => "uint32",
            DType::U64 => "uint64",
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
            DType::F32 => "float32",
            DType::F64 => "float64",
            DType::C64 => "complex64",
            DType::C128 => "complex128",
        }
    }

    /// Parses a dtype name. A bare name is read as numpy reads it (`numpy.dtype(name)` on
    /// Linux): `"float"` and `"double"` are float64, `"int"` and `"long"` int64, `"half"` float16,
    /// `"single"` float32, plus numpy's one-letter codes (`"f"`, `"i"`, `"l"`...). A name after
    /// `torch.` is read as torch spells its dtypes: `"torch.float"` is float32, `"torch.int"`
    /// int32, `"torch.long"` int64, `"torch.half"` float16, `"torch.double"` float64. The
    /// canonical names (`"int32"`, `"float16"`, `"bfloat16"`...) mean the same either way.
    pub fn from_name(name: &str) -> Option<DType> {
        let n = name.trim();
        if let Some(t) = n.strip_prefix("torch.") {
            return Some(match t {
                // "bool", "int8", "bfloat16"...: canonical names, below.
                "short" => DType::I16,
                "int" => DType::I32,
                "long" => DType::I64,
                "half" => DType::F16,
                "float" => DType::F32,
                "double" => DType::F64,
                "cfloat" => DType::C64,
                "cdouble" => DType::C128,
                _ => return Self::canonical(t),
            });
        }
        let n = n.strip_prefix("numpy.").unwrap_or(n);
        Some(match n {
            "bool" | "bool_" | "b1" | "?" => DType::Bool,
            "byte" | "i1" | "b" => DType::I8,
            "short" | "i2" | "h" => DType::I16,
            "intc" | "i4" | "i" => DType::I32,
            "int" | "int_" | "long" | "longlong" | "intp" | "i8" | "l" | "q" | "p" => DType::I64,
            "ubyte" | "u1" | "B" => DType::U8,
            "ushort" | "u2" | "H" => DType::U16,
            "uintc" | "u4" | "I" => DType::U32,
            "uint" | "ulong" | "ulonglong" | "uintp" | "u8" | "L" | "Q" | "P" => DType::U64,
            "half" | "f2" | "e" => DType::F16,
            "single" | "f4" | "f" => DType::F32,
            "float" | "double" | "float_" | "f8" | "d" => DType::F64,
            "csingle" | "c8" | "F" => DType::C64,
            "complex" | "cdouble" | "complex_" | "c16" | "D" => DType::C128,
            _ => return Self::canonical(n),
        })
    }

    /// A canonical name (`"int32"`, `"bfloat16"`...), as [`DType::name`] gives it.
    fn canonical(n: &str) -> Option<DType> {
        DType::ALL.iter().copied().find(|d| d.name() == n)
    }

    /// Whether the dtype is an integer (signed or not) or bool.
    pub const fn is_integral(self) -> bool {
        matches!(
            self,
            DType::Bool
                | DType::I8
                | DType::I16
                | DType::I32
                | DType::I64
                | DType::U8
                | DType::U16
                | DType::U32
                | DType::U64
        )
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A boolean stored as one byte (0 or 1), `Pod` unlike `bool`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(transparent)]
pub struct Bool8(pub u8);

impl From<bool> for Bool8 {
    fn from(b: bool) -> Self {
        Bool8(b as u8)
    }
}

/// A Rust type that is bit-for-bit one element of a [`DType`].
///
/// # Safety
/// Views and step fields size and align memory by [`Element::DTYPE`]: an implementor must have
/// `size_of::<Self>() == Self::DTYPE.itemsize()` and `align_of::<Self>() <= Self::DTYPE.itemsize()`
/// (a wrong claim would let safe code read or write past a slice, or through a misaligned
/// reference).
pub unsafe trait Element: bytemuck::Pod + Send + Sync + 'static {
    /// The matching dtype.
    const DTYPE: DType;
}

macro_rules! element {
    ($($t:ty => $d:expr),* $(,)?) => {
        $(
            // SAFETY: the size is asserted below; every type here is aligned to at most its
            // size (asserted too).
            unsafe impl Element for $t { const DTYPE: DType = $d; }
            assert_eq_size!($t, [u8; $d.itemsize()]);
            const_assert!(std::mem::align_of::<$t>() <= $d.itemsize());
        )*
    };
}

element! {
    Bool8 => DType::Bool,
    i8 => DType::I8, i16 => DType::I16, i32 => DType::I32, i64 => DType::I64,
    u8 => DType::U8, u16 => DType::U16, u32 => DType::U32, u64 => DType::U64,
    half::f16 => DType::F16, half::bf16 => DType::BF16,
    f32 => DType::F32, f64 => DType::F64,
    num_complex::Complex32 => DType::C64, num_complex::Complex64 => DType::C128,
}
