//! Pure DLPack validation: dtype x size matrix from fixtures, and every refusal.

mod common;

use pinstage::DType;
use pinstage::dlpack::DlpackError;
use pinstage::dlpack::MemoryKind;
use pinstage::dlpack::TensorDesc;
use pinstage::dlpack::validate;
use pinstage::dlpack::{DL_CPU, DL_CUDA, DL_CUDA_HOST, DL_CUDA_MANAGED};
use rstest::rstest;

fn desc<'a>(dtype: DType, shape: &'a [i64], strides: Option<&'a [i64]>) -> TensorDesc<'a> {
    let (code, bits) = dtype.dlpack();
    TensorDesc {
        device_type: DL_CUDA,
        device_id: 0,
        data: 0x7f00_0000_1000,
        byte_offset: 64,
        code,
        bits,
        lanes: 1,
        shape,
        strides,
        read_only: false,
    }
}

#[test]
fn fixture_matrix_has_the_promised_entries() {
    assert_eq!(common::sizes(), vec![0, 1, 255, 256, 257, 4096, 1 << 20]);
    assert_eq!(common::dtypes().len(), 15);
}

#[rstest]
fn validates_every_dtype_and_size(
    #[values(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14)] d: usize,
    #[values(0, 1, 2, 3, 4, 5, 6)] s: usize,
) {
    let dtype = common::dtypes()[d];
    let n = common::sizes()[s] as i64;
    for (shape, strides) in [
        (vec![n], Some(vec![1])),
        (vec![n], None),
        (vec![1, n, 1], Some(vec![12345, 1, -7])),
    ] {
        let v = validate(&desc(dtype, &shape, strides.as_deref())).unwrap();
        assert_eq!(v.dtype(), dtype);
        assert_eq!(v.numel(), n as usize);
        assert_eq!(v.nbytes(), n as usize * dtype.itemsize());
        assert_eq!(v.ptr(), 0x7f00_0000_1000 + 64);
        assert_eq!(v.memory(), MemoryKind::Cuda(0));
        assert_eq!(v.shape(), &shape[..]);
    }
    if n > 1 {
        let shape = [n, 2];
        let err = validate(&desc(dtype, &shape, Some(&[1, n]))).unwrap_err();
        assert!(matches!(err, DlpackError::NotContiguous { .. }), "{err}");
    }
}

#[rstest]
#[case::cpu(DL_CPU, 0, MemoryKind::Host)]
#[case::cuda_host(DL_CUDA_HOST, 0, MemoryKind::Host)]
#[case::cuda1(DL_CUDA, 1, MemoryKind::Cuda(1))]
#[case::managed(DL_CUDA_MANAGED, 0, MemoryKind::Cuda(0))]
fn device_types(#[case] ty: u32, #[case] id: i32, #[case] kind: MemoryKind) {
    let mut d = desc(DType::F32, &[4], None);
    d.device_type = ty;
    d.device_id = id;
    assert_eq!(validate(&d).unwrap().memory(), kind);
}

#[test]
fn refusals_name_the_problem() {
    let shape = [4i64];
    let base = desc(DType::I32, &shape, None);
    let cases: Vec<(TensorDesc<'_>, &str)> = vec![
        (
            TensorDesc {
                device_type: 10,
                ..base
            },
            "unsupported DLPack device type 10",
        ),
        (
            TensorDesc {
                device_id: -1,
                ..base
            },
            "invalid DLPack device id -1",
        ),
        (TensorDesc { lanes: 4, ..base }, "lanes 4"),
        (
            TensorDesc {
                code: 2,
                bits: 8,
                ..base
            },
            "code 2, bits 8",
        ),
        (
            TensorDesc {
                code: 3,
                bits: 64,
                ..base
            },
            "code 3",
        ),
        (
            TensorDesc {
                data: 0,
                byte_offset: 0,
                ..base
            },
            "data pointer is null",
        ),
        (
            TensorDesc {
                data: u64::MAX - 8,
                ..base
            },
            "overflows",
        ),
        (
            TensorDesc {
                shape: &[-3],
                ..base
            },
            "dimension 0 is negative",
        ),
        (
            TensorDesc {
                shape: &[i64::MAX, 4],
                ..base
            },
            "overflows",
        ),
        (
            TensorDesc {
                shape: &[4, 4],
                strides: Some(&[4, 2]),
                ..base
            },
            "not contiguous",
        ),
        (
            TensorDesc {
                shape: &[4],
                strides: Some(&[-1]),
                ..base
            },
            "not contiguous",
        ),
    ];
    for (d, needle) in cases {
        let msg = validate(&d).unwrap_err().to_string();
        assert!(msg.contains(needle), "{msg:?} should contain {needle:?}");
    }
}

#[test]
fn raw_dltensor_checks_ndim_and_shape_pointer() {
    use dlpark::ffi::{DLDataType, DLDataTypeCode, DLDevice, DLTensor};
    let shape = [2i64, 3];
    let mut t = DLTensor {
        data: 0x1000 as *mut _,
        device: DLDevice::cuda(0),
        ndim: 2,
        dtype: DLDataType {
            code: DLDataTypeCode::FLOAT,
            bits: 32,
            lanes: 1,
        },
        shape: shape.as_ptr() as *mut i64,
        strides: std::ptr::null_mut(),
        byte_offset: 0,
    };
    // SAFETY: shape points to ndim i64s; no memory behind data is touched.
    let v = unsafe { pinstage::DeviceView::from_dltensor(&t, true) }.unwrap();
    assert!(v.is_read_only());
    assert_eq!(v.numel(), 6);
    t.ndim = -1;
    // SAFETY: ndim is refused before any read.
    assert!(matches!(
        unsafe { pinstage::DeviceView::from_dltensor(&t, false) },
        Err(DlpackError::BadNdim(-1))
    ));
    t.ndim = 2;
    t.shape = std::ptr::null_mut();
    // SAFETY: the null shape is refused before any read.
    assert!(matches!(
        unsafe { pinstage::DeviceView::from_dltensor(&t, false) },
        Err(DlpackError::NullShape(2))
    ));
}

// Moved from the modules' own test blocks.
fn desc32<'a>(shape: &'a [i64], strides: Option<&'a [i64]>) -> TensorDesc<'a> {
    TensorDesc {
        device_type: DL_CUDA,
        device_id: 0,
        data: 0x1000,
        byte_offset: 16,
        code: 0,
        bits: 32,
        lanes: 1,
        shape,
        strides,
        read_only: false,
    }
}

#[test]
fn compact_and_size_one_strides() {
    let v = validate(&desc32(&[2, 3], Some(&[3, 1]))).unwrap();
    assert_eq!((v.numel(), v.nbytes(), v.ptr()), (6, 24, 0x1010));
    assert!(validate(&desc32(&[2, 1, 3], Some(&[3, 999, 1]))).is_ok());
    assert!(validate(&desc32(&[2, 3], None)).is_ok());
    assert!(matches!(
        validate(&desc32(&[2, 3], Some(&[1, 2]))),
        Err(DlpackError::NotContiguous { .. })
    ));
    assert!(matches!(
        validate(&desc32(&[4], Some(&[-1]))),
        Err(DlpackError::NotContiguous { .. })
    ));
    // zero elements: any strides, null data allowed
    let mut d = desc32(&[0, 3], Some(&[7, 7]));
    d.data = 0;
    d.byte_offset = 0;
    assert_eq!(validate(&d).unwrap().numel(), 0);
}

#[test]
fn dlpack_codes_round_trip() {
    for d in DType::ALL {
        let (code, bits) = d.dlpack();
        assert_eq!(DType::from_dlpack(code, bits, 1), Some(d));
        assert_eq!(
            DType::from_dlpack(code, bits, 2),
            None,
            "lanes != 1 refused"
        );
        assert_eq!(DType::from_name(d.name()), Some(d));
        assert_eq!(bits as usize, d.itemsize() * 8);
    }
    assert_eq!(DType::from_dlpack(2, 8, 1), None);
    assert_eq!(DType::from_dlpack(3, 64, 1), None, "opaque handles refused");
    assert_eq!(DType::from_name("torch.int32"), Some(DType::I32));
    assert_eq!(DType::from_name("object"), None);
}

#[test]
fn bare_names_read_as_numpy_torch_names_as_torch() {
    // numpy.dtype(name) on Linux for bare names; torch's spellings after "torch.".
    for (name, d) in [
        ("float", DType::F64),
        ("double", DType::F64),
        ("int", DType::I64),
        ("long", DType::I64),
        ("half", DType::F16),
        ("single", DType::F32),
        ("intc", DType::I32),
        ("complex", DType::C128),
        ("f", DType::F32),
        ("i", DType::I32),
        ("l", DType::I64),
        ("b", DType::I8),
        ("B", DType::U8),
        ("torch.float", DType::F32),
        ("torch.int", DType::I32),
        ("torch.long", DType::I64),
        ("torch.half", DType::F16),
        ("torch.double", DType::F64),
        ("torch.cfloat", DType::C64),
        ("torch.bfloat16", DType::BF16),
        ("numpy.float32", DType::F32),
    ] {
        assert_eq!(DType::from_name(name), Some(d), "{name}");
    }
    // Every other spelling numpy (Linux) and torch give each dtype.
    let spellings: [(&[&str], DType); 14] = [
        (&["bool_", "b1", "?", "torch.bool"], DType::Bool),
        (&["byte", "i1"], DType::I8),
        (&["short", "i2", "h", "torch.short"], DType::I16),
        (&["i4"], DType::I32),
        (&["int_", "longlong", "intp", "i8", "q", "p"], DType::I64),
        (&["ubyte", "u1"], DType::U8),
        (&["ushort", "u2", "H"], DType::U16),
        (&["uintc", "u4", "I"], DType::U32),
        (
            &["uint", "ulong", "ulonglong", "uintp", "u8", "L", "Q", "P"],
            DType::U64,
        ),
        (&["f2", "e"], DType::F16),
        (&["f4"], DType::F32),
        (&["float_", "f8", "d"], DType::F64),
        (&["csingle", "c8", "F"], DType::C64),
        (
            &["cdouble", "complex_", "c16", "D", "torch.cdouble"],
            DType::C128,
        ),
    ];
    for (names, d) in spellings {
        for name in names {
            assert_eq!(DType::from_name(name), Some(d), "{name}");
        }
    }
    assert_eq!(
        DType::from_name("torch.single"),
        None,
        "not a torch spelling"
    );
    assert_eq!(
        DType::from_name("torch.f"),
        None,
        "numpy codes are not torch's"
    );
}

#[test]
fn ndim_limit_is_64_inclusive() {
    let ones = vec![1i64; 64];
    assert!(
        validate(&desc(DType::U8, &ones, None)).is_ok(),
        "64 dimensions"
    );
    for n in [65usize, 70, 1000] {
        let ones = vec![1i64; n];
        assert_eq!(
            validate(&desc(DType::U8, &ones, None)),
            Err(DlpackError::BadNdim(n as i64)),
            "{n} dimensions"
        );
    }
}

#[test]
fn byte_sizes_up_to_isize_max_only() {
    let mut d = desc(DType::U8, &[], None);
    d.data = 1;
    d.byte_offset = 0;
    let max = [isize::MAX as i64];
    d.shape = &max;
    assert_eq!(
        validate(&d).unwrap().nbytes(),
        isize::MAX as usize,
        "isize::MAX bytes"
    );
    let over = [isize::MAX as i64 / 2 + 1];
    let mut d2 = desc(DType::U16, &over, None);
    d2.data = 1;
    d2.byte_offset = 0;
    assert_eq!(
        validate(&d2),
        Err(DlpackError::SizeOverflow),
        "isize::MAX + 1 bytes"
    );
    let huge = [1i64 << 62, 8];
    assert_eq!(
        validate(&desc(DType::U8, &huge, None)),
        Err(DlpackError::SizeOverflow)
    );
}

#[test]
fn metadata_keeps_the_device_type_and_integral_kinds() {
    for (t, id) in [
        (DL_CPU, 0),
        (DL_CUDA_HOST, 0),
        (DL_CUDA, 3),
        (DL_CUDA_MANAGED, 1),
    ] {
        let mut d = desc(DType::I32, &[4], None);
        d.device_type = t;
        d.device_id = id;
        assert_eq!(validate(&d).unwrap().device_type(), t);
    }
    let integral: Vec<DType> = DType::ALL.into_iter().filter(|d| d.is_integral()).collect();
    assert_eq!(integral.len(), 9, "bool and the eight integer types");
    assert!(!DType::F32.is_integral() && !DType::C64.is_integral() && !DType::BF16.is_integral());
    assert!(DType::Bool.is_integral() && DType::U64.is_integral());
    assert_eq!(
        pinstage::dlpack::Bool8::from(true),
        pinstage::dlpack::Bool8(1)
    );
    assert_eq!(
        pinstage::dlpack::Bool8::from(false),
        pinstage::dlpack::Bool8(0)
    );
}
