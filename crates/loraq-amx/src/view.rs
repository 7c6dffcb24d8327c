//! Strided matrix views over f32 slices.

use crate::error::AmxError;

/// A read-only `rows x cols` f32 matrix: element `(i, j)` is
/// `data[i * row_stride + j * col_stride]`.
#[derive(Debug, Clone, Copy)]
pub struct MatrixRef<'a> {
    data: &'a [f32],
    rows: usize,
    cols: usize,
    row_stride: usize,
    col_stride: usize,
}

/// A writable `rows x cols` f32 matrix, row-major or column-major with a leading
/// dimension (distinct elements, so the tasks of a product can write it in parallel).
#[derive(Debug)]
pub struct MatrixMut<'a> {
    data: &'a mut [f32],
    rows: usize,
    cols: usize,
    row_stride: usize,
    col_stride: usize,
}

/// The largest index a `rows x cols` view with these strides touches, `None` on overflow
/// (an empty view touches nothing: `Some(0)`).
fn last_index(rows: usize, cols: usize, row_stride: usize, col_stride: usize) -> Option<usize> {
    if rows == 0 || cols == 0 {
        return Some(0);
    }
    (rows - 1)
        .checked_mul(row_stride)?
        .checked_add((cols - 1).checked_mul(col_stride)?)
}

fn check(
    what: &'static str,
    len: usize,
    rows: usize,
    cols: usize,
    row_stride: usize,
    col_stride: usize,
) -> Result<(), AmxError> {
    match last_index(rows, cols, row_stride, col_stride) {
        None => Err(AmxError::BadView {
            what,
            detail: format!("{rows}x{cols} with strides ({row_stride}, {col_stride}) overflows"),
        }),
        Some(last) if rows > 0 && cols > 0 && last >= len => Err(AmxError::BadView {
            what,
            detail: format!(
                "{rows}x{cols} with strides ({row_stride}, {col_stride}) reaches element {last} of a slice of {len}"
            ),
        }),
        Some(_) => Ok(()),
    }
}

/// The shape accessors and the transpose, the same for both views.
macro_rules! view_shape {
    ($view:ident) => {
        impl<'a> $view<'a> {
            /// The transposed view (no copy).
            pub fn transpose(self) -> $view<'a> {
                $view {
                    data: self.data,
                    rows: self.cols,
                    cols: self.rows,
                    row_stride: self.col_stride,
                    col_stride: self.row_stride,
                }
            }

            /// Number of rows.
            pub fn rows(&self) -> usize {
                self.rows
            }

            /// Number of columns.
            pub fn cols(&self) -> usize {
                self.cols
            }

            /// Distance between consecutive rows, in elements.
            pub fn row_stride(&self) -> usize {
                self.row_stride
            }

            /// Distance between consecutive columns, in elements.
            pub fn col_stride(&self) -> usize {
                self.col_stride
            }
        }
    };
}

view_shape!(MatrixRef);
view_shape!(MatrixMut);

impl<'a> MatrixRef<'a> {
    /// A view with explicit strides; an error when it reaches past `data`.
    pub fn new(
        data: &'a [f32],
        rows: usize,
        cols: usize,
        row_stride: usize,
        col_stride: usize,
    ) -> Result<MatrixRef<'a>, AmxError> {
        check("matrix", data.len(), rows, cols, row_stride, col_stride)?;
        Ok(MatrixRef {
            data,
            rows,
            cols,
            row_stride,
            col_stride,
        })
    }

    /// A row-major `rows x cols` matrix (`data.len()` at least `rows * cols`).
    pub fn row_major(data: &'a [f32], rows: usize, cols: usize) -> Result<MatrixRef<'a>, AmxError> {
        MatrixRef::new(data, rows, cols, cols, 1)
    }

    /// A column-major `rows x cols` matrix.
    pub fn col_major(data: &'a [f32], rows: usize, cols: usize) -> Result<MatrixRef<'a>, AmxError> {
        MatrixRef::new(data, rows, cols, 1, rows)
    }

    /// Element `(i, j)`; panics outside the view.
    pub fn get(&self, i: usize, j: usize) -> f32 {
        assert!(
            i < self.rows && j < self.cols,
            "({i}, {j}) outside {}x{}",
            self.rows,
            self.cols
        );
        self.data[i * self.row_stride + j * self.col_stride]
    }

    /// The underlying slice.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(crate) fn data(&self) -> &'a [f32] {
        self.data
    }
}

impl<'a> MatrixMut<'a> {
    /// A row-major `rows x cols` output with `row_stride >= cols` elements between rows.
    pub fn row_major(
        data: &'a mut [f32],
        rows: usize,
        cols: usize,
        row_stride: usize,
    ) -> Result<MatrixMut<'a>, AmxError> {
        if row_stride < cols && rows > 1 {
            return Err(AmxError::BadView {
                what: "output",
                detail: format!("row stride {row_stride} below {cols} columns"),
            });
        }
        check("output", data.len(), rows, cols, row_stride, 1)?;
        Ok(MatrixMut {
            data,
            rows,
            cols,
            row_stride,
            col_stride: 1,
        })
    }

    /// A column-major `rows x cols` output with `col_stride >= rows` elements between
    /// columns.
    pub fn col_major(
        data: &'a mut [f32],
        rows: usize,
        cols: usize,
        col_stride: usize,
    ) -> Result<MatrixMut<'a>, AmxError> {
        if col_stride < rows && cols > 1 {
            return Err(AmxError::BadView {
                what: "output",
                detail: format!("column stride {col_stride} below {rows} rows"),
            });
        }
        check("output", data.len(), rows, cols, 1, col_stride)?;
        Ok(MatrixMut {
            data,
            rows,
            cols,
            row_stride: 1,
            col_stride,
        })
    }

    /// The underlying slice.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(crate) fn data_mut(&mut self) -> &mut [f32] {
        self.data
    }
}
