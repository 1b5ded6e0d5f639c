"""Vision encoders of the multimodal models (runtime/models/): torch modules over our layers, each turning an
image's pixel patches into the rows its language model reads in place of the image's placeholder tokens."""
