//! Arbitrary DLTensor fields through DLPack validation: it must never panic, and whatever it
//! accepts must be self-consistent (size, contiguity, pointer range).
#![no_main]

use libfuzzer_sys::fuzz_target;
use pinstage::dlpack::{TensorDesc, validate};

fn take<const N: usize>(data: &mut &[u8]) -> [u8; N] {
    let mut out = [0u8; N];
    let n = N.min(data.len());
    out[..n].copy_from_slice(&data[..n]);
    *data = &data[n..];
    out
}

fuzz_target!(|input: &[u8]| {
    let mut data = input;
    let device_type = u32::from_le_bytes(take(&mut data)) % 20;
    let device_id = i32::from_le_bytes(take(&mut data));
    let ptr = u64::from_le_bytes(take(&mut data));
    let byte_offset = u64::from_le_bytes(take(&mut data));
    let [code, bits, lanes_lo, flags] = take::<4>(&mut data);
    let ndim = (flags % 8) as usize;
    let with_strides = flags & 0x80 != 0;
    let mut shape = Vec::with_capacity(ndim);
    let mut strides = Vec::with_capacity(ndim);
    for _ in 0..ndim {
        // small dims most of the time, any i64 sometimes
        let raw = i64::from_le_bytes(take(&mut data));
        shape.push(if raw & 1 == 0 { (raw >> 1) % 70 } else { raw >> 1 });
        strides.push(i64::from_le_bytes(take(&mut data)) % 5000);
    }
    let desc = TensorDesc {
        device_type,
        device_id,
        data: ptr,
        byte_offset,
        code: code % 8,
        bits,
        lanes: lanes_lo as u16 % 3,
        shape: &shape,
        strides: with_strides.then_some(&strides[..]),
        read_only: flags & 0x40 != 0,
    };
    if let Ok(v) = validate(&desc) {
        let numel: usize = shape.iter().map(|&d| d as usize).product();
        assert_eq!(v.numel(), numel);
        assert_eq!(v.nbytes(), numel * v.dtype().itemsize());
        assert!(v.ptr().checked_add(v.nbytes() as u64).is_some());
        assert!(numel == 0 || ptr != 0);
        assert_eq!(v.shape(), &shape[..]);
    }
});
