//! The whole DLPack descriptor through validation: arbitrary device types and ids, data pointer
//! and byte offset, dtype code/bits/lanes, the read-only flag, ndim up to 70 (past the limit of
//! 64), strides of any length or none, shapes of any sign and size; both through `validate`
//! (a `TensorDesc`) and through `meta_of_dltensor` (a raw `DLTensor`, null shape and strides
//! pointers included). It must never panic, and whatever it accepts must be self-consistent.
#![no_main]

use dlpark::ffi::{DLDataType, DLDataTypeCode, DLDevice, DLDeviceType, DLTensor};
use libfuzzer_sys::fuzz_target;
use pinstage::dlpack::{DL_CPU, DL_CUDA, DL_CUDA_HOST, DL_CUDA_MANAGED};
use pinstage::dlpack::DlpackError;
use pinstage::dlpack::MAX_NDIM;
use pinstage::dlpack::MemoryKind;
use pinstage::dlpack::TensorDesc;
use pinstage::dlpack::TensorMeta;
use pinstage::dlpack::meta_of_dltensor;
use pinstage::dlpack::validate;

fn take<const N: usize>(data: &mut &[u8]) -> [u8; N] {
    let mut out = [0u8; N];
    let n = N.min(data.len());
    out[..n].copy_from_slice(&data[..n]);
    *data = &data[n..];
    out
}

/// Checks an accepted tensor against the fields it came from.
fn consistent(m: &TensorMeta, device_type: u32, device_id: i32, data: u64, offset: u64, shape: &[i64], strides: Option<&[i64]>) {
    let numel: usize = shape.iter().map(|&d| d as usize).product();
    assert!(shape.len() <= MAX_NDIM);
    assert!(shape.iter().all(|&d| d >= 0));
    assert_eq!(m.numel(), numel);
    assert_eq!(m.nbytes(), numel * m.dtype().itemsize());
    assert_eq!(m.ptr(), data + offset);
    assert!(m.ptr().checked_add(m.nbytes() as u64).is_some());
    assert!(numel == 0 || data != 0);
    assert_eq!(m.shape(), shape);
    assert_eq!(m.device_type(), device_type);
    match device_type {
        DL_CPU | DL_CUDA_HOST => assert_eq!(m.memory(), MemoryKind::Host),
        DL_CUDA | DL_CUDA_MANAGED => assert_eq!(m.memory(), MemoryKind::Cuda(device_id)),
        _ => panic!("device type {device_type} accepted"),
    }
    if let (Some(s), true) = (strides, numel > 0) {
        // Row-major compact, size-1 dimensions excepted.
        let mut expect = 1i64;
        for (&d, &st) in shape.iter().zip(s).rev() {
            assert!(d == 1 || st == expect, "strides {s:?} for {shape:?}");
            expect = expect.saturating_mul(d.max(1));
        }
    }
}

fuzz_target!(|input: &[u8]| {
    let mut data = input;
    let [dt, mode, ndim_raw, flags] = take::<4>(&mut data);
    // Mostly the device types pinstage knows, any value sometimes.
    let device_type = match dt % 6 {
        0 => DL_CPU,
        1 => DL_CUDA,
        2 => DL_CUDA_HOST,
        3 => DL_CUDA_MANAGED,
        _ => u32::from_le_bytes(take(&mut data)),
    };
    let device_id = i32::from_le_bytes(take(&mut data));
    let ptr = u64::from_le_bytes(take(&mut data));
    let byte_offset = u64::from_le_bytes(take(&mut data));
    let [code, bits, lanes_lo, lanes_hi] = take::<4>(&mut data);
    let lanes = if flags & 1 == 0 { 1 } else { u16::from_le_bytes([lanes_lo, lanes_hi]) };
    let ndim = (ndim_raw % 71) as usize;
    let mut shape = Vec::with_capacity(ndim);
    for _ in 0..ndim {
        // Small dims most of the time, any i64 sometimes.
        let raw = i64::from_le_bytes(take(&mut data));
        shape.push(if raw & 1 == 0 { (raw >> 1) % 70 } else { raw >> 1 });
    }
    // Strides: none, compact, or arbitrary of any length.
    let strides: Option<Vec<i64>> = match mode % 3 {
        0 => None,
        1 => {
            let mut acc = 1i64;
            let mut s = vec![0i64; ndim];
            for (st, &d) in s.iter_mut().zip(&shape).rev() {
                *st = acc;
                acc = acc.saturating_mul(d.max(1));
            }
            Some(s)
        }
        _ => {
            let len = if flags & 2 == 0 { ndim } else { (mode as usize / 3) % 72 };
            Some((0..len).map(|_| i64::from_le_bytes(take(&mut data)) % 5000).collect())
        }
    };
    let read_only = flags & 4 != 0;
    let desc = TensorDesc {
        device_type,
        device_id,
        data: ptr,
        byte_offset,
        code,
        bits,
        lanes,
        shape: &shape,
        strides: strides.as_deref(),
        read_only,
    };
    let via_desc = validate(&desc);
    if let Ok(m) = &via_desc {
        consistent(m, device_type, device_id, ptr, byte_offset, &shape, strides.as_deref());
        assert_eq!(m.is_read_only(), read_only);
        assert_eq!(m.dtype().dlpack(), (code, bits));
        assert_eq!(lanes, 1);
    }
    if shape.len() > MAX_NDIM {
        assert!(via_desc.is_err(), "ndim {} accepted", shape.len());
    }
    // The same fields as a raw DLTensor (strides of ndim entries, or null; shape null sometimes).
    let mut shape_buf = shape.clone();
    let mut strides_buf = strides.clone().filter(|s| s.len() == ndim);
    let null_shape = flags & 8 != 0;
    let t = DLTensor {
        data: ptr as *mut std::ffi::c_void,
        device: DLDevice {
            device_type: DLDeviceType(device_type),
            device_id,
        },
        ndim: if flags & 16 != 0 { -(ndim as i32) - 1 } else { ndim as i32 },
        dtype: DLDataType {
            code: DLDataTypeCode(code),
            bits,
            lanes,
        },
        shape: if null_shape { std::ptr::null_mut() } else { shape_buf.as_mut_ptr() },
        strides: strides_buf.as_mut().map_or(std::ptr::null_mut(), |s| s.as_mut_ptr()),
        byte_offset,
    };
    // SAFETY: shape and strides point to `ndim` i64s (or are null), alive for the call.
    let via_raw = unsafe { meta_of_dltensor(&t, read_only) };
    if t.ndim < 0 {
        assert!(matches!(via_raw, Err(DlpackError::BadNdim(_))));
    } else if null_shape && ndim > 0 {
        assert!(matches!(via_raw, Err(DlpackError::NullShape(_)) | Err(DlpackError::BadNdim(_))));
    } else if let Ok(m) = &via_raw {
        consistent(m, device_type, device_id, ptr, byte_offset, &shape, strides_buf.as_deref());
    }
});
