"""Float arithmetic shared by the kernels (XLA and Pallas alike)."""


def two_sum(a, b):
  """(s, e) with s = fl(a + b) and a + b = s + e exactly (Knuth's TwoSum).

  Plain array arithmetic, so it runs inside Pallas kernels as well as in XLA;
  the compensated in-chunk cumsums of both GDN kernels are built on it
  (math.md, "The compensated cumsum").
  """
  s = a + b
  b_virtual = s - a
  e = (a - (s - b_virtual)) + (b - b_virtual)
  return s, e
