"""Images for vision-language models: reading image files safely and turning them into the pixel values and image
tokens each family's Hugging Face processor makes (``pixel_values``, ``image_grid_thw``, ``token_type_ids``)."""
