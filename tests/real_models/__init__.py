"""The real-model suite: Hugging Face / peft / timm models from small configs."""
