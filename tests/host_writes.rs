//! The host side of a stager copy: how a slot is written (values, then padding; serially or
//! split over threads) and how its bytes are shaped into one copy.

use pinstage::testing::{row_shape, write_padded, write_padded_parallel};

#[test]
fn row_shapes_cover_the_bytes_exactly() {
    assert_eq!(row_shape(16384), Some((1024, 16)));
    assert_eq!(row_shape(2048), Some((1024, 2)));
    assert_eq!(row_shape(32768), Some((1024, 32)));
    assert_eq!(row_shape(2560), Some((512, 5)));
    assert_eq!(row_shape(2304), Some((256, 9)));
    for total in [0usize, 4, 1024, 2047, 2050, 4100, 32769, 65536, 1 << 20] {
        assert_eq!(row_shape(total), None, "{total}");
    }
    for total in 0..70_000usize {
        if let Some((w, h)) = row_shape(total) {
            assert_eq!(w * h, total);
            assert!(h >= 2 && w >= 256);
        }
    }
}

#[test]
fn parallel_write_matches_serial() {
    if cfg!(miri) {
        return;
    }
    for itemsize in [1usize, 2, 4, 8, 16] {
        for (n, total_elems) in [
            (0usize, 300_000usize),
            (100_000, 300_000),
            (300_000, 300_000),
        ] {
            let total = total_elems * itemsize;
            let values: Vec<u8> = (0..n * itemsize).map(|i| (i % 253) as u8 + 1).collect();
            let pad: Vec<u8> = (0..itemsize).map(|i| 0xC0 + i as u8).collect();
            let mut a = vec![0xEEu8; total];
            let mut b = vec![0x11u8; total];
            write_padded(&mut a, &values, Some(&pad));
            write_padded_parallel(&mut b, &values, Some(&pad));
            assert!(a == b, "itemsize {itemsize}, {n} of {total_elems}");
        }
    }
}

#[test]
fn write_padded_layout() {
    for itemsize in [1usize, 2, 4, 8, 16] {
        for total_elems in [0usize, 1, 3, 255, 256, 257, 1000] {
            if cfg!(miri) && total_elems > 257 {
                continue;
            }
            for n in [0usize, 1, total_elems / 2, total_elems] {
                if n > total_elems {
                    continue;
                }
                let values: Vec<u8> = (0..n * itemsize).map(|i| (i % 251) as u8 + 1).collect();
                let pad: Vec<u8> = (0..itemsize).map(|i| 0xA0 + i as u8).collect();
                let mut out = vec![0xEEu8; total_elems * itemsize + 7];
                write_padded(&mut out[..total_elems * itemsize], &values, Some(&pad));
                assert_eq!(&out[..values.len()], &values[..]);
                for e in n..total_elems {
                    assert_eq!(&out[e * itemsize..(e + 1) * itemsize], &pad[..]);
                }
                assert!(out[total_elems * itemsize..].iter().all(|&b| b == 0xEE));
            }
        }
    }
}

#[test]
fn padding_is_kept_only_for_the_same_pad_and_total() {
    use pinstage::testing::same_padding;
    let p4: &[u8] = &[1, 2, 3, 4];
    let q4: &[u8] = &[1, 2, 3, 5];
    assert!(same_padding((10, 64, Some(p4)), (20, 64, Some(p4))));
    assert!(
        !same_padding((10, 64, Some(p4)), (20, 64, Some(q4))),
        "another pad value"
    );
    assert!(
        !same_padding((10, 64, Some(p4)), (20, 128, Some(p4))),
        "another total"
    );
    assert!(
        !same_padding((10, 64, Some(&[1, 2])), (20, 64, Some(&[1, 2, 0, 0]))),
        "another pad size"
    );
    assert!(
        !same_padding((10, 64, None), (20, 64, None)),
        "no padding to keep"
    );
    assert!(!same_padding((10, 64, None), (20, 64, Some(p4))));
}
